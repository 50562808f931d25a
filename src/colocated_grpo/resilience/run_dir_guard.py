"""The run directory, claimed before Hydra writes its record (`.hydra/`) into it; the lock is held until the process
ends, and a process the holder starts for the same directory (a server placement's trainer) inherits it (`HELD_ENV`).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from filelock import FileLock, Timeout
from hydra.experimental.callback import Callback

from colocated_grpo import run_files
from colocated_grpo.resilience import checkpoints

HELD_ENV = "COLOCATED_GRPO_RUN_DIR_HELD"  # the run directory a parent process holds for its children
OTHER_RANKS_WAIT_S = 30  # a refused launch's other ranks leave the message to rank 0, which torchrun then reports

_held: dict[Path, object] = {}  # run directory -> its lock, for the life of this process
_records: dict[Path, dict[str, str]] = {}  # run directory -> the Hydra record of the run it held before this launch


class RunDirRefused(SystemExit):
    """The run directory cannot be used (a SystemExit: Hydra turns it into neither a traceback nor a warning)."""


class RunDirGuard(Callback):
    """A Hydra callback (`hydra.callbacks` in conf/train.yaml), first at `on_run_start`: a directory that cannot be
    created or written is refused in one line; rank 0 takes its lock, so a second launch into a directory in use is
    refused before Hydra rewrites the live run's record; only rank 0 writes Hydra's record."""

    def on_run_start(self, config, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf, read_write

        HydraConfig.instance().set_config(config)  # what run_job does first: ${hydra:…} in the path resolves
        run_dir = Path(os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir"))))
        main = run_files.is_main_process()
        try:
            check_writable(run_dir, main)
        except RunDirRefused as refused:
            if not main:  # rank 0 says it; torchrun stops this rank when rank 0 exits
                time.sleep(OTHER_RANKS_WAIT_S)
            print(f"error: {refused.code}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        if not main:
            with read_write(config.hydra):
                config.hydra.output_subdir = None
        elif (run_dir / run_files.RUN).exists() and (hydra_dir := run_dir / run_files.HYDRA).is_dir():
            # the record of the run the directory holds, put back by restore_record if this launch is refused
            _records[run_dir.resolve()] = {p.name: p.read_text() for p in hydra_dir.glob("*.yaml")}


def check_writable(run_dir: Path, claim_it: bool = True) -> None:
    """Create `run_dir` and (rank 0) claim it, or raise RunDirRefused saying why."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        if claim_it:
            claim(run_dir)
        elif not os.access(run_dir, os.W_OK):
            raise PermissionError(13, "Permission denied", str(run_dir))
    except checkpoints.ResumeError as err:
        raise RunDirRefused(str(err)) from None
    except OSError as err:
        raise RunDirRefused(
            f"hydra.run.dir={run_dir} cannot be used as the run directory: {describe(err, run_dir)}; choose a "
            "directory you can write, e.g. hydra.run.dir=outputs/runs/NAME"
        ) from None


def describe(err: OSError, run_dir: Path) -> str:
    """The system's reason, with the path it concerns (the first existing ancestor that is not a directory, if any)."""
    reason = err.strerror or str(err)
    existing = next(p for p in [run_dir, *run_dir.parents] if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a directory ({reason})"
    return f"{reason}: {err.filename or run_dir}"


def restore_record(run_dir: Path) -> None:
    """Put back the Hydra record of the run the directory held before this launch (refused before it started)."""
    for name, text in _records.pop(Path(run_dir).resolve(), {}).items():
        run_files.write_text(Path(run_dir) / run_files.HYDRA / name, text)


def claim(run_dir: Path) -> None:
    """Hold `run_dir` for this process (rank 0) until it ends; ResumeError when another process holds it. Claiming
    a directory this process, or the process that started it, already holds does nothing."""
    run_dir = Path(run_dir).resolve()
    if run_dir in _held or os.environ.get(HELD_ENV) == str(run_dir):
        return
    lock = FileLock(str(run_dir / ".run.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise checkpoints.ResumeError(
            f"{run_dir} is in use by another training process (it holds {lock.lock_file}); "
            "wait for it to end, or choose another hydra.run.dir"
        ) from None
    _held[run_dir] = lock
    os.environ[HELD_ENV] = str(run_dir)
