"""A study directory that names no machine path, so that it can be kept with the code: after a study runs, every path
of this machine in its files (run.json, job.json, Hydra's records, logs) is rewritten, but for those of a run that
did not finish (its resume compares its config with them). Paths in the checkout become
relative to it (`train.py`, `conf`, `sweeps/results/NAME/runs/…`, as the commands in results.md are written, run
from the repo root); a study directory outside the checkout becomes `OUT`; Python's packages, the model cache and the
home directory become `<site-packages>`, `<python>`, `<cache>` and `<home>`; other temporary files (torchrun's error
files) `<tmp>`."""

from __future__ import annotations

import os
import re
import site
import sys
import tempfile
from pathlib import Path

from colocated_grpo.provenance import REPO

# What is never rewritten: figures and other binary files are left as they are.
BINARY_SUFFIXES = {".png", ".pdf", ".pt", ".bin", ".safetensors", ".wandb"}


def machine_roots(out: str | Path) -> list[tuple[str, str]]:
    """(absolute path, what it becomes) for this machine and a study directory OUT."""
    out = Path(out).resolve()
    study = str(out.relative_to(REPO)) if out.is_relative_to(REPO) else "OUT"
    roots = [(str(out), study), (str(REPO), ".")]
    roots += [(path, "<site-packages>") for path in {*site.getsitepackages(), site.getusersitepackages()}]
    roots += [(sys.prefix, "<python>"), (sys.base_prefix, "<base-python>")]  # a venv's and the interpreter's own
    roots += [(str(Path.home()), "<home>"), (tempfile.gettempdir(), "<tmp>")]
    if cache := os.environ.get("COLOCATED_GRPO_CACHE"):
        roots.append((str(Path(cache).resolve()), "<cache>"))
    return roots


def rewrite_text(text: str, roots: list[tuple[str, str]]) -> str:
    """`text` with each root replaced, the longest first (a study directory inside the checkout is the study's); a root
    matches a whole path component only (`/tmp/sweep` is not part of `/tmp/sweep_2`). A root that becomes `.` is
    dropped before the rest of a path (`/repo/train.py` → `train.py`)."""
    for root, name in sorted(roots, key=lambda r: len(r[0]), reverse=True):
        root = root.rstrip("/")
        if len(root) < 2:  # `/` itself names nothing in particular
            continue
        # A whole path: not the tail of a longer one (`/data/repo`), not followed by more of a name.
        pattern = r"(?<![\w.-])(?<![\w.-]/)" + re.escape(root) + r"(?![\w.+=,-])(/?)"
        text = re.sub(pattern, lambda m, name=name: "" if name == "." and m.group(1) else name + m.group(1), text)
    return text


def rewrite(directory: str | Path, roots: list[tuple[str, str]], keep: list[Path] = ()) -> list[Path]:
    """Rewrite every text file under `directory` (see rewrite_text) but those under `keep`; returns the files that
    changed."""
    changed = []
    for path in sorted(Path(directory).rglob("*")):
        if not path.is_file() or path.is_symlink() or path.suffix in BINARY_SUFFIXES:
            continue
        if any(path.is_relative_to(kept) for kept in keep):
            continue
        try:
            text = path.read_bytes().decode()  # bytes: a log's carriage returns (progress bars) stay as they are
        except UnicodeDecodeError:
            continue
        if (new := rewrite_text(text, roots)) != text:
            path.write_bytes(new.encode())
            changed.append(path)
    return changed
