"""Stop cleanly on SIGTERM (SLURM preemption; torchrun forwards it to every worker) and on Ctrl-C (SIGINT): the
handler only records the signal; at the end of the step every rank learns whether any rank got one (a gather), and
together they save a checkpoint and stop; the runner exits with 128 + the signal number and says how to resume.
A second signal stops at once, without a checkpoint, unless it comes within REPEAT_WINDOW_S (the same Ctrl-C
delivered twice: by the terminal and by torchrun).

Also stop at a non-finite loss, reward or gradient norm, at the step that logged it and before a checkpoint of the
damaged weights is saved (`run.stop_on_nonfinite`; non-finite values of single rewards are caught earlier, naming
function and sample, in training/rewards.py). A step that saves is logged too, whatever trainer.logging_steps says:
NaN weights give a NaN gradient norm at every later step, so each save is checked against all the steps before it."""

from __future__ import annotations

import logging
import math
import signal
import time
from contextlib import contextmanager

import torch
from accelerate.utils import gather
from transformers import TrainerCallback

from colocated_grpo.resilience import signals
from colocated_grpo.resilience.checkpoints import latest
from colocated_grpo.resilience.signals import StoppedAtOnce

log = logging.getLogger(__name__)

REPEAT_WINDOW_S = 5.0
CHECKED = ("loss", "reward", "grad_norm")  # the logged values StopOnNonFinite checks


class StopOnSignal(TrainerCallback):
    def __init__(self):
        self.signum: int | None = None  # the signal this process received, or that another rank reported
        self.stopped_at: int | None = None  # the step after which training stopped for it
        self._first_at = 0.0
        self._steps_done = 0
        self._restore = lambda: None

    @contextmanager
    def installed(self):
        """Handle SIGTERM/SIGINT while the block runs (main thread only); the previous handlers come back after."""
        with signals.during_training(self._handle) as self._restore:
            yield self

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is None:
            self.signum, self._first_at = signum, time.monotonic()
            log.warning(
                f"{name} received: saving a checkpoint and stopping at the end of the current step (send it again "
                f"after {REPEAT_WINDOW_S:.0f} s to stop at once, without a checkpoint)"
            )
            return
        if time.monotonic() - self._first_at < REPEAT_WINDOW_S:
            return
        self._restore()
        raise StoppedAtOnce(
            signum,
            f"{name} received again: stopped at once in step {self._steps_done + 1}, without a checkpoint of it; "
            "the same command resumes from the latest checkpoint",
        )

    def stop_in_step(self, why: str) -> StoppedAtOnce | None:
        """Where the step in progress cannot finish (`why` says what ended it) after a signal asked to stop: that
        stop, at once; None when no signal came."""
        if self.signum is None:
            return None
        name = signal.Signals(self.signum).name
        return StoppedAtOnce(
            self.signum,
            f"{name} received, then {why}: stopped in step {self._steps_done + 1}, without a checkpoint of it; "
            "the same command resumes from the latest checkpoint",
        )

    def on_step_end(self, args, state, control, **kwargs):
        self._steps_done = state.global_step
        # any rank's signal, the same on every rank (a gather: itself on one process)
        if signum := int(gather(torch.tensor([self.signum or 0], dtype=torch.int64, device=args.device)).max()):
            self.signum = self.signum or signum
            self.stopped_at = state.global_step
            control.should_save = control.should_training_stop = True


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
