"""A run that fails because its disk is full (an OSError with errno ENOSPC or EDQUOT, an error whose message is the
OS's for them, as safetensors' and torch.distributed.checkpoint's are, or torch's checkpoint writer failing, often
chained): said in one line, with the directory and the space left; the same command resumes."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path

from colocated_grpo.compat.vllm import exception_chain

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_WORDS = re.compile("|".join(os.strerror(e) for e in FULL_ERRNOS))  # "No space left on device (os error 28)"
NEARLY_FULL_BYTES = 64 * 2**20  # a writer that failed with less than this left is taken to have run out of space
# torch.save's errors when its file cannot grow: no errno, only the C++ stream's words
TORCH_WRITER_FAILED = re.compile(r"iostream error|inline_container\.cc|PytorchStreamWriter failed")


class DiskFull(RuntimeError):
    """The run directory's disk (or quota) is full; the message names it, the space left and what to do."""


def explain(exc: BaseException, run_dir: Path, then: str) -> DiskFull | None:
    """DiskFull when `exc` (or an error it was raised from or during) ran out of space, else None; `then`: what next."""
    chain = list(exception_chain(exc))
    for dcp in [c for c in chain if type(c).__name__ == "CheckpointException"]:  # FSDP2's save: every rank's error
        chain += [e for failed, _ in dcp.failures.values() for e in exception_chain(failed)]
    by_errno = any(e.errno in FULL_ERRNOS if isinstance(e, OSError) else FULL_WORDS.search(str(e)) for e in chain)
    a_write_failed = any(isinstance(e, OSError) or TORCH_WRITER_FAILED.search(str(e)) for e in chain)
    usage = None
    with contextlib.suppress(OSError):
        usage = shutil.disk_usage(run_dir)
    nearly_full = usage is not None and usage.free < NEARLY_FULL_BYTES
    if not (by_errno or (a_write_failed and nearly_full)):  # any other error on a nearly full disk is its own
        return None
    space = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB" if usage else "free space unknown"
    first = chain[-1]  # the first error raised: what was being written when the space ran out
    text = " ".join(str(first).split())
    text = text if len(text) <= 160 else text[:157] + "..."
    return DiskFull(
        f"no space left on the disk of the run directory {run_dir} ({space}; {type(first).__name__}: "
        f"{text}). Free some space, then {then}"
    )
