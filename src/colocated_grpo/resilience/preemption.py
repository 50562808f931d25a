"""Stop cleanly on SIGTERM (SLURM preemption; torchrun forwards it to every worker) and on Ctrl-C (SIGINT): the
handler only records the signal; at the end of the step every rank learns whether any rank got one (a gather), and
together they save a checkpoint and stop; the runner exits with 128 + the signal number and says how to resume.
A second signal stops at once, without a checkpoint, unless it comes within REPEAT_WINDOW_S (the same Ctrl-C
delivered twice: by the terminal and by torchrun)."""

from __future__ import annotations

import logging
import signal
import time
from contextlib import contextmanager

import torch
from accelerate.utils import gather
from transformers import TrainerCallback

from colocated_grpo.resilience import signals
from colocated_grpo.resilience.signals import StoppedAtOnce

log = logging.getLogger(__name__)

REPEAT_WINDOW_S = 5.0


class TrainingInterrupted(SystemExit):
    """Training stopped on a signal; the exit status is 128 + signal number and str() says how to resume."""

    def __init__(self, signum: int, message: str):
        super().__init__(128 + signum)
        self.signum, self.message = signum, message

    def __str__(self) -> str:
        return self.message


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
                "%s received: saving a checkpoint and stopping at the end of the current step "
                "(send it again after %.0f s to stop at once, without a checkpoint)",
                name,
                REPEAT_WINDOW_S,
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

    def on_step_end(self, args, state, control, **kwargs):
        self._steps_done = state.global_step
        # any rank's signal, the same on every rank (a gather: itself on one process)
        if signum := int(gather(torch.tensor([self.signum or 0], dtype=torch.int64, device=args.device)).max()):
            self.signum = self.signum or signum
            self.stopped_at = state.global_step
            control.should_save = control.should_training_stop = True
