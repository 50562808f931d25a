"""Rewards with the faults a real reward function can have, for end-to-end failure tests.

Loaded by runs that put this directory on PYTHONPATH and set `+reward.modules=[faulty_rewards]`.
"""

from colocated_grpo.training.rewards import register


@register
def nan_on_second(completions, **_):
    """NaN for the second completion of every call (0/0 in a hand-written ratio, say)."""
    return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]


@register
def fails_on_odd_answer(completions, answer, **_):
    """Raises for the first sample whose reference answer is odd."""
    for a in answer:
        if int(a) % 2:
            raise ZeroDivisionError("odd answers are not handled")
    return [0.0] * len(completions)


@register
def nan_loss_at_step(completions, log_metric, step: int = 0, **_):
    """A reward of weight 0 that turns the loss of step `step` into NaN, as an overflow in the forward would: the
    gradients and the weights the step's update leaves are NaN."""
    trainer = log_metric.__self__  # TRL passes its own bound method
    if "compute_loss" not in vars(trainer):
        loss = trainer.compute_loss

        def compute_loss(*args, **kwargs):
            return loss(*args, **kwargs) * (float("nan") if trainer.state.global_step + 1 == step else 1.0)

        trainer.compute_loss = compute_loss
    return [0.0] * len(completions)
