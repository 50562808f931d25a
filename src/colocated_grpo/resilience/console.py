"""What a run prints: a failure reported once per launch, and known noise of the libraries filtered at its source.

A failure: the whole traceback goes to the job's log file (`<run dir>/train.log`, Hydra's file handler) on every
rank; the console gets `Type: message` once per launch, from rank 0 or the first rank that failed (a rank that
fails because another one did says nothing), with the traceback only where the message does not explain itself.
Under torchrun the same line goes to the worker's error file, so torchrun's closing ChildFailedError block names
the error instead of "To enable traceback see …". The process then ends at once: the interpreter's teardown would
print dozens of `nanobind: leaked …` lines (triton's bindings) after the error.

Noise filtered, each by its exact source: W&B's Weave advertisement (`WANDB_DISABLE_WEAVE`), transformers'
FutureWarnings about the `gradient_checkpointing` names that TRL still reads, and transformers' "missing keys in the
checkpoint" on resume when the missing keys are tied weights (`lm_head.weight` of a model with tied embeddings,
which the checkpoint stores once and loading ties again).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from colocated_grpo import run_files

log = logging.getLogger(__name__)

OTHER_RANKS_WAIT_S = 2.0  # a failing rank other than 0 lets a failing rank 0 report first
CLAIMS_DIR = Path(tempfile.gettempdir())  # where the ranks of one launch claim its failure report
CLAIM_PREFIX = "colocated-grpo-failure-"


def quiet_known_noise() -> None:
    os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")
    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing` is deprecated", category=FutureWarning)


class _TiedKeysMissing(logging.Filter):
    def __init__(self, tied: set[str]):
        super().__init__()
        self.tied = tied

    def filter(self, record: logging.LogRecord) -> bool:
        m = re.match(r"There were missing keys in the checkpoint model loaded: \[(.*)\]\.$", record.getMessage())
        if not m:
            return True
        missing = {k.strip().strip("'\"") for k in m[1].split(",") if k.strip()}
        return not (missing and missing <= self.tied)


def quiet_tied_weights_on_resume(model) -> None:
    """Drop transformers' missing-keys warning on resume when every missing key is a tied weight of `model`."""
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    if tied:
        logging.getLogger("transformers.trainer").addFilter(_TiedKeysMissing(tied))


def report_failure(exc: BaseException, explained: bool, show_cause: bool = False) -> None:
    """Log `exc` with its traceback to the log files; print it on the console once per launch (a traceback only
    when not `explained`; with `show_cause`, the traceback of its cause, e.g. the frames of a user's reward)."""
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
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        info = {"py_callstack": line, "timestamp": str(int(time.time()))}
        Path(error_file).write_text(json.dumps({"message": {"message": line, "extraInfo": info}}))


def exit_now(code: int) -> None:
    """End the process without the interpreter's teardown (see the module's docstring)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _first_to_report() -> bool:
    """Whether this process reports its launch's failure: always when it is the only process, else the first of the
    launch's processes on this node to claim it (rank 0 gets a head start)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:  # not started by torchrun (a LOCAL_RANK alone may be left over)
        return True
    if _rank() != 0:
        time.sleep(OTHER_RANKS_WAIT_S)
    import psutil

    agent = psutil.Process(os.getppid())  # the torchrun agent: the ranks' parent, one claim per launch and node
    # The claim must outlive the reporting rank (another rank may fail minutes later, at a collective's timeout), so
    # it stays while its agent lives: outside the run directory, and removed by a later claim once the agent is gone.
    _remove_claims_of_ended_agents()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # an agent restarting its workers: a new launch
    claim = CLAIMS_DIR / f"{CLAIM_PREFIX}{agent.pid}-{agent.create_time():.0f}-{restart}"
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False
    except OSError:
        return _rank() == 0


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
