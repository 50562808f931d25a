"""SIGTERM during start-up, before the runner installs its own handler (resilience/preemption.py): Python's default
would kill the process at once (exit -15, nothing said, nothing recorded). Until then SIGTERM unwinds like Ctrl-C
does, so a run that recorded itself says `interrupted` and the process exits 143 (128 + SIGTERM). Standard library
only (console.py is too): train.py installs it before anything heavy is imported."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable

from colocated_grpo.resilience import console


class StoppedInStartup(KeyboardInterrupt):
    """SIGTERM before the first step; `code` is the exit status."""

    code = 128 + signal.SIGTERM


def _raise(signum, frame) -> None:
    raise StoppedInStartup("SIGTERM during start-up: stopped before the first step, nothing trained")


def run(main: Callable[[], None]) -> None:
    """Call `main` with SIGTERM unwinding as StoppedInStartup until the runner installs its own handler; a stop
    before the runner can report it (Hydra still composing or writing its record) ends here, in one line."""
    signal.signal(signal.SIGTERM, _raise)
    try:
        main()
    except StoppedInStartup as stop:
        print(stop, file=sys.stderr, flush=True)
        console.exit_now(stop.code)  # without the interpreter's teardown (triton's "nanobind: leaked …" lines)


ENDING_GRACE_S = 10.0  # how long a run's ending may take before a SIGTERM received in it is honoured
_ending_since: float | None = None


def over() -> None:
    """The run is ending (its record, W&B and process group being closed, or its failure reported): from here on
    a SIGTERM, e.g. torchrun's when another rank failed, is not taken for a stop in start-up and does not cut the
    ending short; but an ending that hangs (wandb.finish, destroy_process_group) is stopped ENDING_GRACE_S after it
    began, exit 143, once a SIGTERM came. Ctrl-C still stops at once."""
    global _ending_since
    if _ending_since is None:
        _ending_since = time.monotonic()
    signal.signal(signal.SIGTERM, _during_ending)


def _during_ending(signum, frame) -> None:
    left = ENDING_GRACE_S - (time.monotonic() - _ending_since)
    if left <= 0:
        _stop_ending()
    else:  # the process normally ends first, and the timer with it
        timer = threading.Timer(left, _stop_ending)
        timer.daemon = True
        timer.start()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one timer is enough


def _stop_ending() -> None:
    print(
        f"SIGTERM: the run's ending (run files, W&B, process group) took over {ENDING_GRACE_S:.0f} s; stopped",
        file=sys.stderr,
        flush=True,
    )
    console.exit_now(128 + signal.SIGTERM)
