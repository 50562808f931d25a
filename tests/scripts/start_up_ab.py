"""Wall and CPU time of `python train.py` in two checkouts, interleaved (A B, then B A, so that the machine's drift
falls on both): the tiny default run, and a run its config refuses. Each checkout runs its own `src` with its own
.venv (the interpreter running this script where it has none). Prints each run, then the medians per case and
checkout:

    python tests/scripts/start_up_ab.py /path/to/checkout_a /path/to/checkout_b --pairs 5
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {"tiny": ["logger=none"], "refused": ["logger=none", "trainer.max_steps=abc"]}  # refused by its config


def timed_run(checkout: Path, overrides: list[str], run_dir: Path) -> tuple[float, float, int]:
    """(wall s, CPU s of the process and its children, exit code) of one `train.py` in `checkout`."""
    venv_python = checkout / ".venv" / "bin" / "python"
    python = str(venv_python) if venv_python.exists() else sys.executable
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    proc = subprocess.run(
        [python, "train.py", f"hydra.run.dir={run_dir}", *overrides],
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout / "src"), os.environ.get("PYTHONPATH", "")])},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    args = parser.parse_args()
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.pairs):
            order = ("a", "b") if i % 2 == 0 else ("b", "a")
            for case in args.cases:
                for side in order:
                    checkout = getattr(args, side)
                    wall, cpu, code = timed_run(checkout, CASES[case], Path(scratch, f"{case}-{side}-{i}"))
                    print(
                        f"pair {i + 1}/{args.pairs} {case:8s} {side} ({checkout}): {wall:6.2f} s wall, "
                        f"{cpu:6.2f} s CPU, exit {code}",
                        flush=True,
                    )
                    results.setdefault((case, side), []).append((wall, cpu))
    print("\nmedians")
    for (case, side), runs in sorted(results.items()):
        wall = statistics.median(r[0] for r in runs)
        cpu = statistics.median(r[1] for r in runs)
        print(f"  {case:8s} {side}: {wall:6.2f} s wall, {cpu:6.2f} s CPU ({len(runs)} runs, {getattr(args, side)})")


if __name__ == "__main__":
    main()
