"""The run-directory contract: the name of every file a run, a sweep job or a sweep writes, the step key that
joins them, and their JSON / JSONL I/O. The local files are the source of truth for a run; W&B mirrors them."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path

# The key that orders every per-step record (TRL's global step); plots use it as their x axis, not W&B's step.
STEP_KEY = "train/global_step"

# A run directory (`hydra.run.dir`), written by rank 0:
CONFIG = "config.yaml"  # the resolved config, credentials redacted
HYDRA = ".hydra"  # Hydra's own record of the job (config, overrides, hydra.yaml), credentials redacted
RUN = "run.json"  # placement, world size, git sha, package versions, overrides, W&B id, status, each attempt
METRICS = "metrics.jsonl"  # one line per logged step (TRL's metrics and ours), flushed as it is written
SUMMARY = "summary.json"  # steady-state means of every metric, rewritten each step
TRAINER_SUMMARY = "trainer_summary.json"  # the trainer's end-of-training totals
GPU_SAMPLES = "gpu_samples.jsonl"  # every NVML sample of every GPU, with rank, step and phase
PHASES = "phases.jsonl"  # every rank's phase intervals of every step
ROLLOUTS = "rollouts.jsonl"  # rank 0's prompts, completions, each reward's scores and their weighted total per step
CHECKPOINT_PREFIX = "checkpoint-"  # checkpoint-<step>/: what a run resumes from
# A server-placement run adds:
PLACEMENT = "placement.json"  # which GPUs serve and train, and the ports
SERVER_LOG = "vllm_server.log"
TRAINER_LOG = "trainer.log"
# A sweep job's directory adds, and the sweep directory holds:
JOB = "job.json"  # overrides, command, status, exit code, error, log tail, times
JOB_LOG = "job.log"  # the job's stdout and stderr
SWEEP_SUMMARY = "summary.csv"  # one row per job


def is_main_process() -> bool:
    """Rank 0 of the job (torchrun's RANK; a plain `python train.py` is rank 0): it writes run files and W&B."""
    return int(os.environ.get("RANK", "0")) == 0


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return _jsonable(value.item())
    return value


class JsonlWriter:
    """Appends one JSON object per line and flushes each, so a killed run keeps every line written. UTF-8 text, not
    `\\u` escapes: a prompt in any language reads (and greps) as written."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the writer's life, closed by close()

    def write(self, record: dict) -> None:
        self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_text(path: Path, text: str | Iterable[str]) -> None:
    """Write atomically and durably (a temp file beside it, fsynced, renamed over it; removed if the write fails)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines([text] if isinstance(text, str) else text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=2, default=str))


def read_json(path: str | Path) -> dict | None:
    """A JSON file's content, or None when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_jsonl(path: str | Path) -> list[dict]:
    """All complete lines of a JSONL file (a torn last line is skipped); [] when there is no such file yet."""
    if not Path(path).exists():
        return []
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def flatten(tree: dict, sep: str = ".", prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1} (with `sep`); an empty mapping stays a leaf."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, sep, name + sep))
        else:
            flat[name] = value
    return flat


def log_to_files(logger: logging.Logger, level: int, message: str, exc_info=None) -> None:
    """A log record for the run's log files only (Hydra's train.log), not for the console."""
    record = logger.makeRecord(logger.name, level, __file__, 0, message, (), exc_info)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
