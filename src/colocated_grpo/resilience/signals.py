"""Every signal handler of the package, one per process role and phase; no other module installs one (a test checks
it). What each does is the table "What a signal does, by process and phase" in docs/resilience.md, whose rows name
these functions. Also how a process ends: on a failure (`report_failure`, printed once per launch) or at once
(`exit_now`). Standard library only: train.py installs the start-up handler before anything heavy is imported.

- a trainer (`python train.py`, a torchrun worker, the server placement's orchestrator, the plain-TRL bench):
  - start-up and loading, `run_main`: SIGTERM unwinds as StoppedAtOnce (exit 143, one line); Ctrl-C is Python's own
    KeyboardInterrupt;
  - training, `during_training`: SIGTERM and SIGINT go to the preemption callback (preemption.py), which stops every
    rank at the end of the step with a checkpoint (`stopping_at_once` for the plain-TRL bench: stopped at once);
  - the ending, `ending`: SIGTERM lets the ending go on, and stops one that hangs ENDING_GRACE_S after it began;
  - under torchrun, `stop_with_torchrun_agent`: SIGTERM when the torchrun agent dies, even by SIGKILL.
- an orchestrator of jobs (a sweep, a study), `sigterm_as_interrupt`: SIGTERM stops it as Ctrl-C does, so that the
  running job is stopped and recorded, not orphaned.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from colocated_grpo import run_files

log = logging.getLogger(__name__)

ENDING_GRACE_S = 10.0  # how long a run's ending may take before a SIGTERM received in it is honoured
_ending_since: float | None = None


class StoppedAtOnce(KeyboardInterrupt):
    """A signal stopped the process where it was, without a checkpoint; `code` is the exit status, str() says so."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.code = 128 + signum


def run_main(main: Callable[[], None]) -> None:
    """Call `main` with SIGTERM unwinding as StoppedAtOnce until training installs its own handler; a stop before
    the run can report it (Hydra still composing or writing its record) ends here, in one line."""
    signal.signal(signal.SIGTERM, _stop_in_start_up)
    try:
        main()
    except StoppedAtOnce as stop:
        print(stop, file=sys.stderr, flush=True)
        exit_now(stop.code)


def _stop_in_start_up(signum, frame) -> None:
    raise StoppedAtOnce(signum, "SIGTERM during start-up: stopped before the first step, nothing trained")


def during_training(handler: Callable[[int, object], None]):
    """SIGTERM and SIGINT go to `handler` while the block runs (main thread only); the previous handlers come back
    after it, or when `handler` calls the `restore` this yields."""
    return _handled(handler, (signal.SIGTERM, signal.SIGINT))


def stopping_at_once():
    """For a trainer that saves nothing on a signal (the plain-TRL bench): SIGTERM and Ctrl-C while the block runs
    stop it at once (StoppedAtOnce), saying that it was in training."""
    return _handled(_stop_in_training, (signal.SIGTERM, signal.SIGINT))


def _stop_in_training(signum, frame) -> None:
    name = signal.Signals(signum).name
    raise StoppedAtOnce(signum, f"{name} during training: stopped at once, without a checkpoint (none is saved)")


@contextlib.contextmanager
def _handled(handler: Callable[[int, object], None], signums: tuple[int, ...]) -> Iterator[Callable[[], None]]:
    previous = {sig: signal.signal(sig, handler) for sig in signums}

    def restore() -> None:
        while previous:
            sig, old = previous.popitem()
            signal.signal(sig, old)

    try:
        yield restore
    finally:
        restore()


def ending() -> None:
    """The run is ending (run files, W&B, process group, failure report): a SIGTERM no longer cuts it short, but
    stops an ending that hangs ENDING_GRACE_S after it began, exit 143. Ctrl-C still stops at once."""
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
    exit_now(128 + signal.SIGTERM)


def stop_with_torchrun_agent() -> None:
    """Under torchrun, receive SIGTERM when the agent (this process's parent) dies, even by SIGKILL, and stop as a
    preempted run does, rather than train on orphaned in a session of its own. Linux only."""
    import ctypes

    if not torchrun_worker() or not sys.platform.startswith("linux"):
        return
    agent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != agent:  # the agent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def sigterm_as_interrupt():
    """SIGTERM (kill, a scheduler) stops an orchestrator of jobs as Ctrl-C does: the running job is stopped, not
    orphaned."""
    return _handled(_interrupt, (signal.SIGTERM,))


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


# ------------------------------------------------------------------------------------------ how a process ends

OTHER_RANKS_WAIT_S = 2.0  # a failing rank other than 0 lets a failing rank 0 report first
CLAIMS_DIR = Path(tempfile.gettempdir())  # where the ranks of one launch claim its failure report
CLAIM_PREFIX = "colocated-grpo-failure-"


def torchrun_worker() -> bool:
    """Started by torchrun (its agent sets TORCHELASTIC_RUN_ID; a LOCAL_RANK alone may be left over)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def report_failure(exc: BaseException, explained: bool, show_cause: bool = False) -> None:
    """Log `exc` with its traceback to the log files; print it on the console once per launch (a traceback only
    when not `explained`; with `show_cause`, the traceback of its cause, e.g. the frames of a user's reward), and
    to torchrun's error file, so that its closing block names the error instead of "To enable traceback see …"."""
    failed_at = str(int(time.time()))  # before the wait below: torchrun's root cause is the earliest failure
    line = f"{type(exc).__name__}: {exc}"
    run_files.log_to_files(log, logging.ERROR, "run failed", (type(exc), exc, exc.__traceback__))
    if not _first_to_report():
        return
    if not explained:
        traceback.print_exception(exc)  # its last line is `line`
    else:
        if show_cause and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__)
        print(line, file=sys.stderr)
    sys.stderr.flush()
    # Not torch's ErrorHandler.record_exception: it writes the whole traceback, which torchrun's closing block repeats
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        info = {"py_callstack": line, "timestamp": failed_at}
        Path(error_file).write_text(json.dumps({"message": {"message": line, "extraInfo": info}}))


def exit_now(code: int) -> None:
    """End the process without the interpreter's teardown, which prints dozens of `nanobind: leaked …` lines."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _first_to_report() -> bool:
    """Whether this process reports its launch's failure: the only process does, else the first of the launch's
    processes on this node to claim it (rank 0 gets a head start). Not rank 0 alone: when another rank fails first,
    rank 0 fails in the next collective and would print that consequence (a gather cut off by the peer) instead of
    the cause (test_a_failing_two_rank_run_prints_its_error_once_without_the_libraries_noise)."""
    if not torchrun_worker():
        return True
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if not rank0:
        time.sleep(OTHER_RANKS_WAIT_S)
    import psutil

    agent = psutil.Process(os.getppid())  # the torchrun agent: the ranks' parent, one claim per launch and node
    # a claim stays while its agent lives (another rank may fail minutes later); later claims remove the rest
    _remove_claims_of_ended_agents()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # an agent restarting its workers: a new launch
    claim = CLAIMS_DIR / f"{CLAIM_PREFIX}{agent.pid}-{agent.create_time():.0f}-{restart}"
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return rank0


def _remove_claims_of_ended_agents() -> None:
    import psutil

    for claim in CLAIMS_DIR.glob(f"{CLAIM_PREFIX}*-*"):
        pid, started, *_ = [*claim.name.removeprefix(CLAIM_PREFIX).split("-"), ""]
        try:
            alive = f"{psutil.Process(int(pid)).create_time():.0f}" == started
        except (ValueError, psutil.Error):
            alive = False
        if not alive:
            with contextlib.suppress(OSError):  # another user's, in a shared temp dir: theirs to remove
                claim.unlink()
