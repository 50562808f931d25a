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
