"""Load runs and sweeps for tables, notebooks and tests.

A run directory is the source of truth (see run_files). Its steady-state numbers come from `summary.json` when the
run wrote one (phase timings, throughput, GPU utilisation per phase, peak memory) and otherwise from what
`metrics.jsonl` holds: TRL's `step_time` after the first step, the growth of `num_tokens`, the last `reward`.

A sweep directory holds one job directory per job, each with `job.json` (written by the sweep launcher: overrides,
status, exit code, the last lines of its log) and, once it ran, the run files.

    python -m colocated_grpo.analysis SWEEP_DIR     # print the summary table and rewrite SWEEP_DIR/summary.csv
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from colocated_grpo.run_files import read_json, read_jsonl

# Steady-state means that a run's summary.json holds (telemetry), in the metric names of the W&B run.
SUMMARY_KEYS = (
    "timing_s/step", "timing_s/generate", "timing_s/sync_weights", "timing_s/reward", "timing_s/train",
    "perf/tokens_per_s", "perf/tokens_per_s_per_gpu",
    "gpu/util_generate", "gpu/util_sync_weights", "gpu/util_reward", "gpu/util_train",
    "memory/peak_gb",
)  # fmt: skip

# Columns of a sweep summary, in order; the printed table shows the short names.
COLUMNS = ("job", "overrides", "status", "exit_code", *SUMMARY_KEYS, "reward", "steps", "source", "note", "dir")
TABLE = {
    "job": "#", "overrides": "overrides", "status": "status", "timing_s/step": "step s",
    "perf/tokens_per_s_per_gpu": "tok/s/GPU", "gpu/util_generate": "util gen", "gpu/util_sync_weights": "util sync",
    "gpu/util_reward": "util rew", "gpu/util_train": "util train", "memory/peak_gb": "peak GB", "reward": "reward",
    "note": "note",
}  # fmt: skip

JOB_FILE = "job.json"
SUMMARY_CSV = "summary.csv"


def run_summary(run_dir: str | Path) -> dict:
    """Steady-state numbers of one run: summary.json's where it has them, else derived from metrics.jsonl.

    Keys: SUMMARY_KEYS (None where neither file says), `reward` (the last logged), `steps` (the last global
    step) and `source` (the file the timings came from, None when the run logged nothing).
    """
    run_dir = Path(run_dir)
    summary = _flatten(read_json(run_dir / "summary.json") or {})
    metrics = read_jsonl(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    run = read_json(run_dir / "run.json") or {}
    derived = _from_metrics(metrics, int(run.get("world_size") or 1))
    row = {key: _number(summary.get(key)) for key in SUMMARY_KEYS}
    for key, value in derived.items():
        if row.get(key) is None:
            row[key] = value
    rewards = [m["reward"] for m in metrics if m.get("reward") is not None]
    steps = [m["train/global_step"] for m in metrics if "train/global_step" in m]
    row["reward"] = rewards[-1] if rewards else None
    row["steps"] = steps[-1] if steps else None
    row["source"] = "summary.json" if summary else ("metrics.jsonl" if metrics else None)
    return row


def _from_metrics(metrics: list[dict], world_size: int) -> dict:
    """Step time and token throughput from TRL's per-step `step_time` and cumulative `num_tokens`.

    The first logged step (engine warm-up, compilation) is left out when there is more than one. A line logged every
    k steps carries the mean step time of those k steps and the tokens of all of them.
    """
    rows, last_step, last_tokens = [], 0, 0.0
    for m in metrics:
        step, seconds, tokens = m.get("train/global_step"), m.get("step_time"), m.get("num_tokens")
        if step is None or seconds is None:
            continue
        rows.append((step - last_step, seconds * (step - last_step), None if tokens is None else tokens - last_tokens))
        last_step, last_tokens = step, tokens if tokens is not None else last_tokens
    steady = rows[1:] if len(rows) > 1 else rows
    steps, seconds = sum(r[0] for r in steady), sum(r[1] for r in steady)
    if not steps or seconds <= 0:
        return {}
    out = {"timing_s/step": seconds / steps}
    if all(r[2] is not None for r in steady):
        out["perf/tokens_per_s"] = sum(r[2] for r in steady) / seconds
        out["perf/tokens_per_s_per_gpu"] = out["perf/tokens_per_s"] / world_size
    return out


def load_jobs(sweep_dir: str | Path) -> list[dict]:
    """One row per job of a sweep (COLUMNS), ordered by job number.

    Jobs are the directories with a job.json; a directory with only run files (a sweep run by another launcher)
    counts too, its status taken from run.json.
    """
    sweep_dir = Path(sweep_dir)
    job_dirs = sorted({p.parent for p in sweep_dir.rglob(JOB_FILE)}) or sorted(
        {p.parent for p in sweep_dir.rglob("run.json")}
    )
    rows = []
    for job_dir in job_dirs:
        job = read_json(job_dir / JOB_FILE)
        if job is None:
            run = read_json(job_dir / "run.json")
            if run is None:
                continue
            job = {"num": None, "overrides": [], "status": run.get("status")}
        row = {
            "job": job.get("num"),
            "overrides": " ".join(job.get("swept") or job.get("overrides") or []),
            "status": job.get("status"),
            "exit_code": job.get("exit_code"),
            **run_summary(job_dir),
            "note": job.get("reason") or job.get("error"),
            "dir": str(job_dir.relative_to(sweep_dir)),
        }
        rows.append({key: row.get(key) for key in COLUMNS})
    rows.sort(key=lambda r: (r["job"] is None, r["job"] if r["job"] is not None else 0, r["dir"]))
    return rows


def load_sweep(sweep_dir: str | Path):
    """The sweep summary as a pandas DataFrame (one row per job, COLUMNS)."""
    import pandas as pd

    return pd.DataFrame(load_jobs(sweep_dir), columns=list(COLUMNS))


def write_summary(sweep_dir: str | Path) -> Path:
    """Write SWEEP_DIR/summary.csv from the job directories; returns its path."""
    path = Path(sweep_dir) / SUMMARY_CSV
    load_sweep(sweep_dir).to_csv(path, index=False)
    return path


def print_summary(sweep_dir: str | Path, file=None) -> None:
    """Print the summary as a table (rich)."""
    from rich.console import Console
    from rich.table import Table

    rows = load_jobs(sweep_dir)
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    title = f"sweep {Path(sweep_dir).name}: " + ", ".join(f"{n} {s}" for s, n in counts.items())
    table = Table(title=title, show_lines=False)
    for key, header in TABLE.items():
        text = key in ("overrides", "status", "note")
        table.add_column(header, overflow="fold", justify="left" if text else "right")
    for r in rows:
        table.add_row(*(_cell(r[key], 160 if key == "note" else None) for key in TABLE))
    file = file or sys.stdout
    Console(file=file, width=None if file.isatty() else 200).print(table)


def _cell(value, max_chars: int | None = None) -> str:
    if isinstance(value, str) and max_chars and len(value) > max_chars:
        return value[: max_chars - 1] + "…"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _flatten(data: dict, prefix: str = "") -> dict:
    """{"timing_s": {"step": 1.0}} and {"timing_s/step": 1.0} both become {"timing_s/step": 1.0}."""
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}/"))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _number(value) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -m colocated_grpo.analysis SWEEP_DIR")
    print_summary(argv[0])
    print(f"summary: {write_summary(argv[0])}")


if __name__ == "__main__":
    main()
