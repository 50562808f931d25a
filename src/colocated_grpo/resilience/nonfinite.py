"""Stop at a non-finite loss, reward or gradient norm, at the step that logged it and before a checkpoint of the
damaged weights is saved (`run.stop_on_nonfinite`; non-finite values of single rewards are caught earlier, naming
function and sample, in training/rewards.py). A step that saves is logged too, whatever trainer.logging_steps says:
NaN weights give a NaN gradient norm at every later step, so each save is checked against all the steps before it."""

from __future__ import annotations

import math

from transformers import TrainerCallback

from colocated_grpo.resilience.checkpoints import latest

CHECKED = ("loss", "reward", "grad_norm")


class NonFiniteError(RuntimeError):
    pass


class StopOnNonFinite(TrainerCallback):
    """Raise NonFiniteError when a logged loss, reward or grad norm is NaN or infinite. The last callback: a save that
    any other asks for at the end of a step (a signal's) makes the step logged before it is saved."""

    def on_step_end(self, args, state, control, **kwargs):
        control.should_log = control.should_log or control.should_save

    on_epoch_end = on_step_end

    def on_log(self, args, state, control, logs=None, **kwargs):
        bad = {k: logs[k] for k in CHECKED if k in (logs or {}) and not _finite(logs[k])}
        if args.fp16:  # the loss scaler skips steps with an infinite gradient norm; those are expected
            bad.pop("grad_norm", None)
        if not bad:
            return
        last = latest(args.output_dir)
        values = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise NonFiniteError(
            f"non-finite {values} at step {state.global_step}: training stopped before these weights are saved. "
            f"Last checkpoint: {last.path if last else 'none'}. Usual causes: rewards too large for float32 "
            "(|r| > 3.4e38) or infinite, a learning rate that makes the policy diverge, fp16 overflow (use bf16). "
            "Set run.stop_on_nonfinite=false to train on regardless."
        )


def _finite(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return True  # not a number: nothing to check
