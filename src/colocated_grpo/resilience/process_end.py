"""How a process ends: on a failure (`report_failure`, printed once per launch) or at once (`exit_now`); on a signal
through signals.py. Standard library only, as signals.py, which train.py imports before anything heavy."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from colocated_grpo import run_files

log = logging.getLogger(__name__)

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
    # Not torchrun's @record error files: its agent prints them only once every rank has ended, inside its own
    # failure summary; a claim lets the first rank that fails print its one line as it fails.
    if not torchrun_worker():
        return True
    if not (rank0 := run_files.is_main_process()):
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
