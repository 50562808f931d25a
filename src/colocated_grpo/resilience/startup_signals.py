"""SIGTERM during start-up, before the runner installs its own handler (resilience/preemption.py): Python's default
would kill the process at once (exit -15, nothing said, nothing recorded). Until then SIGTERM unwinds like Ctrl-C
does, so a run that recorded itself says `interrupted` and the process exits 143 (128 + SIGTERM). Standard library
only (console.py is too): train.py installs it before anything heavy is imported."""

from __future__ import annotations

import signal
import sys
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


def over() -> None:
    """The run is ending (its record, W&B and process group being closed, or its failure reported): from here on
    SIGTERM, e.g. torchrun's when another rank failed, is ignored rather than taken for a stop in start-up, and
    cannot cut the ending short. Ctrl-C still stops at once."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
