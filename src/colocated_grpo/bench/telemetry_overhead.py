"""What does the telemetry cost? Runs the same training with `telemetry=default` and `telemetry=off`,
interleaved, and compares TRL's own steady-state `step_time` (logged in both). Also prints the directly measured
costs inside the telemetry runs: the callback's work and the CUDA synchronisations at phase edges per step, and
the NVML sampler thread's read time.

    python -m colocated_grpo.bench.telemetry_overhead --nproc 1 --repeats 2 -- \
        +experiment=gpu_smoke trainer.max_steps=10
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from colocated_grpo import run_files
from colocated_grpo.launch import processes
from colocated_grpo.provenance import checkout, command_parser
from colocated_grpo.run_files import STEP_KEY, read_jsonl


def run_once(out: Path, name: str, nproc: int, overrides: list[str]) -> list[dict]:
    run_dir = out / name
    overrides = [*overrides, f"parallelism.nproc_per_node={nproc}", f"hydra.run.dir={run_dir}", "logger=none"]
    cmd = processes.train_command(nproc, overrides, checkout() / "train.py")
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    (run_dir / "launch.log").unlink(missing_ok=True)
    rc = processes.run(cmd, run_dir / "launch.log")  # Ctrl-C stops torchrun, its workers and vLLM's processes too
    if rc != 0:
        sys.exit(f"[{name}] failed with exit code {rc}; see {run_dir / 'launch.log'}")
    return read_jsonl(run_dir / run_files.METRICS)


def main(argv=None, prog: str | None = None) -> None:
    parser = command_parser("colocated_grpo.bench.telemetry_overhead", __doc__, prog)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="pairs of (on, off) runs, interleaved")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of each run")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/telemetry_overhead"))
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args(argv)

    steady = {"on": [], "off": []}
    in_step, sampler = [], []  # the costs the telemetry runs measure themselves, as shares of each step
    for i in range(args.repeats):
        for mode, telemetry in (("on", "default"), ("off", "off")):
            metrics = run_once(args.out, f"{mode}_{i}", args.nproc, [*args.overrides, f"telemetry={telemetry}"])
            rows = [m for m in metrics if m[STEP_KEY] > args.warmup]
            if not rows:
                sys.exit(f"no steps after {args.warmup} warm-up steps: raise trainer.max_steps")
            steady[mode] += [m["step_time"] for m in rows]
            if mode == "on":
                for m in rows:
                    callback = m.get("telemetry/callback_s", 0) + m.get("telemetry/barrier_s", 0)
                    in_step.append(callback / m["step_time"])
                    sampler.append(m.get("telemetry/sampler_s", 0) / m["step_time"])

    on, off = statistics.median(steady["on"]), statistics.median(steady["off"])
    print(f"\nsteady-state step_time (TRL's), median over {len(steady['on'])} / {len(steady['off'])} steps:")
    print(f"  telemetry on : {on:.4f} s   (stdev {statistics.pstdev(steady['on']):.4f})")
    print(f"  telemetry off: {off:.4f} s   (stdev {statistics.pstdev(steady['off']):.4f})")
    print(f"  A/B overhead : {100 * (on / off - 1):+.2f} % of step time (noise: see the stdevs)")
    print("direct costs inside the telemetry runs, per step:")
    print(f"  callback + phase-edge synchronisation: {100 * statistics.mean(in_step):.3f} % of step time")
    print(f"  NVML sampler reads (own thread)      : {100 * statistics.mean(sampler):.3f} % of step time")


if __name__ == "__main__":
    main()
