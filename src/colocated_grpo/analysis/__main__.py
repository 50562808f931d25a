"""python -m colocated_grpo.analysis SWEEP_DIR                # print the summary table, rewrite SWEEP_DIR/summary.csv
python -m colocated_grpo.analysis RUN_DIR                  # print one run's numbers (nothing is written)
python -m colocated_grpo.analysis render DIR [--out OUT]   # a sweep's or a run's figures as PNGs (DIR/figures)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from colocated_grpo.analysis.notebook import FIGURES, require_extra
from colocated_grpo.analysis.tables import is_run_dir, load_jobs, print_run, print_summary, write_summary

PROG = "python -m colocated_grpo.analysis"


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["render"]:
        render(argv[1:], prog or f"{PROG} render")
    else:
        summary(argv, prog or PROG)


def summary(argv: list[str], prog: str) -> None:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Print a sweep's summary table and rewrite its summary.csv; given a run directory, print that "
        "run's numbers and write nothing.",
    )
    parser.add_argument("dir", metavar="DIR", help="a sweep directory (job directories inside) or a run directory")
    directory = Path(parser.parse_args(argv).dir)
    if not directory.is_dir():
        parser.exit(2, f"error: {directory}: {'not a directory' if directory.exists() else 'no such directory'}\n")
    if is_run_dir(directory):  # one run: its numbers; summary.csv belongs to a sweep, not inside a run
        print_run(directory)
        return
    rows = load_jobs(directory)
    print_summary(directory, rows=rows)
    print(f"summary: {write_summary(directory, rows)}")


def render(argv: list[str], prog: str) -> None:
    parser = argparse.ArgumentParser(prog=prog, description="Write the figures of a sweep or a run directory as PNGs.")
    parser.add_argument("dir", help="a sweep directory (job directories inside) or a run directory")
    parser.add_argument("--out", help="where to write the PNGs (default: DIR/figures)")
    args = parser.parse_args(argv)
    require_extra("notebooks", FIGURES, "render")
    from colocated_grpo.analysis import plots

    for path in plots.render(args.dir, args.out):
        print(path)


if __name__ == "__main__":
    main()
