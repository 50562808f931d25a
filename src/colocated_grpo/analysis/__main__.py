"""python -m colocated_grpo.analysis SWEEP_DIR                # print the summary table, rewrite SWEEP_DIR/summary.csv
python -m colocated_grpo.analysis render DIR [--out OUT]   # a sweep's or a run's figures as PNGs (DIR/figures)
"""

from __future__ import annotations

import sys

from colocated_grpo.analysis.tables import load_jobs, print_summary, write_summary
from colocated_grpo.provenance import FIGURES, require_extra


def main(argv: list[str] | None = None) -> None:
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["render"]:
        parser = argparse.ArgumentParser(
            prog="python -m colocated_grpo.analysis render",
            description="Write the figures of a sweep or a run directory as PNGs.",
        )
        parser.add_argument("dir", help="a sweep directory (job directories inside) or a run directory")
        parser.add_argument("--out", help="where to write the PNGs (default: DIR/figures)")
        args = parser.parse_args(argv[1:])
        require_extra("notebooks", FIGURES, "render")
        from colocated_grpo.analysis import plots

        for path in plots.render(args.dir, args.out):
            print(path)
        return
    if len(argv) != 1 or argv[0].startswith("-"):
        sys.exit(
            "usage: python -m colocated_grpo.analysis SWEEP_DIR\n"
            "       python -m colocated_grpo.analysis render SWEEP_OR_RUN_DIR [--out DIR]"
        )
    rows = load_jobs(argv[0])
    print_summary(argv[0], rows=rows)
    print(f"summary: {write_summary(argv[0], rows)}")


if __name__ == "__main__":
    main()
