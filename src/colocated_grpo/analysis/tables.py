"""Runs and sweeps as rows of numbers, for tables, notebooks, figures and tests: a run's steady-state numbers from its
`summary.json`, else from its `metrics.jsonl` (the run directory is the source of truth, see run_files); `load_sweep`
makes one row per job directory of a sweep (its `job.json` and, once it ran, its run files), placement beside numbers.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from colocated_grpo import run_files
from colocated_grpo.run_files import STEP_KEY, flatten, read_json, read_jsonl
from colocated_grpo.telemetry.phases import PHASES

# Steady-state means that a run's summary.json holds (telemetry), in the metric names of the W&B run.
SUMMARY_KEYS = (
    *(f"timing_s/{phase}" for phase in ("step", *PHASES)),
    "perf/tokens_per_s",
    "perf/tokens_per_s_per_gpu",
    "perf/tokens_per_s_per_train_gpu",
    "perf/gen_tokens_per_s",
    *(f"gpu/util_{phase}" for phase in ("generate", "sync_weights", "reward", "train")),
    "memory/peak_gb",
    "vllm/kv_cache_tokens",
)

# Where a job ran: placement name, trainer processes, GPUs used (a vLLM server's included), and vLLM's TP size and
# memory fraction (the server's own for server placement; empty without vLLM).
PLACEMENT_KEYS = ("placement", "world_size", "gpus", "vllm_tensor_parallel_size", "vllm_gpu_memory_utilization")

# Columns of a sweep summary, in order; the printed table shows the short names.
COLUMNS = (
    "job",
    "overrides",
    "status",
    "exit_code",
    *PLACEMENT_KEYS,
    *SUMMARY_KEYS,
    "reward",
    "steps",
    "source",
    "note",
    "dir",
)
TABLE = {
    "job": "#",
    "overrides": "overrides",
    "status": "status",
    "timing_s/step": "step s",
    "perf/tokens_per_s_per_gpu": "tok/s/GPU",
    "gpu/util_generate": "util gen",
    "gpu/util_sync_weights": "util sync",
    "gpu/util_reward": "util rew",
    "gpu/util_train": "util train",
    "memory/peak_gb": "peak GB",
    "reward": "reward",
    "note": "note",
}


def run_summary(run_dir: str | Path) -> dict:
    """Steady-state numbers of one run (summary_row) and `source`: the file they came from, None if neither."""
    run_dir = Path(run_dir)
    summary = read_json(run_dir / run_files.SUMMARY) or {}
    metrics = read_jsonl(run_dir / run_files.METRICS)
    run = read_json(run_dir / run_files.RUN) or {}
    row = summary_row(summary, metrics, int(run.get("world_size") or 1))
    row["source"] = run_files.SUMMARY if summary else (run_files.METRICS if metrics else None)
    return row


def summary_row(summary: dict, metrics: list[dict], world_size: int = 1) -> dict:
    """SUMMARY_KEYS (None where unknown), `reward` (the last) and `steps` (the last global step) from a steady-state
    summary (summary.json, a W&B run's) and the per-step metrics (may be empty); the summary wins where both say."""
    summary = flatten(summary, "/")  # {"timing_s": {"step": 1.0}} and {"timing_s/step": 1.0} alike
    numbers = {key: value for key in SUMMARY_KEYS if (value := _number(summary.get(key))) is not None}
    row = {**dict.fromkeys(SUMMARY_KEYS), **_from_metrics(metrics, world_size), **numbers}
    rewards = [m["reward"] for m in metrics if m.get("reward") is not None]
    steps = [m[STEP_KEY] for m in metrics if STEP_KEY in m]
    row["reward"] = rewards[-1] if rewards else _number(summary.get("final/reward"))
    row["steps"] = steps[-1] if steps else _number(summary.get(STEP_KEY))
    return row


def placement_settings(get: Callable[[str], object], world_size: int | None = None) -> dict:
    """PLACEMENT_KEYS of a job from its config (file, W&B run or DictConfig), read through `get(dotted key)`."""
    name = get("placement.name")
    world = int(world_size or get("parallelism.nproc_per_node") or 1)
    server_gpus = 0
    if name == "server":  # the server's own engine: its TP and memory fraction, on GPUs of its own
        tp, memory = get("placement.server_tensor_parallel_size"), get("placement.gpu_memory_utilization")
        server_gpus = int(get("placement.server_gpus") or 0)
    elif get("trainer.use_vllm"):
        tp, memory = get("trainer.vllm_tensor_parallel_size") or 1, get("trainer.vllm_gpu_memory_utilization")
    else:
        tp = memory = None
    return {
        "placement": name,
        "world_size": world,
        "gpus": world + server_gpus,
        "vllm_tensor_parallel_size": None if tp is None else int(tp),
        "vllm_gpu_memory_utilization": _number(memory),
    }


def run_placement(run_dir: str | Path) -> dict:
    """PLACEMENT_KEYS of a run directory (config.yaml and run.json); empty values where it has neither."""
    run_dir = Path(run_dir)
    run = read_json(run_dir / run_files.RUN) or {}
    cfg = _read_yaml(run_dir / run_files.CONFIG)
    if cfg is None:
        return {**dict.fromkeys(PLACEMENT_KEYS), "placement": run.get("placement"), "world_size": run.get("world_size")}
    return placement_settings(lambda key: _select(cfg, key), run.get("world_size"))


def _from_metrics(metrics: list[dict], world_size: int) -> dict:
    """Step time and token throughput from TRL's per-step `step_time` and cumulative `num_tokens`, without the first
    logged step (warm-up) when there are more. A line logged every k steps holds their mean step time."""
    rows, last_step, last_tokens = [], 0, 0.0
    for m in metrics:
        step, seconds, tokens = m.get(STEP_KEY), m.get("step_time"), m.get("num_tokens")
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


# ------------------------------------------------------------------------------------------------------ sweeps


def load_jobs(sweep_dir: str | Path) -> list[dict]:
    """One row per job of a sweep (COLUMNS) by job number: each directory with a job.json, else with a run.json."""
    sweep_dir = Path(sweep_dir)
    job_dirs = sorted({p.parent for p in sweep_dir.rglob(run_files.JOB)})
    job_dirs = job_dirs or sorted({p.parent for p in sweep_dir.rglob(run_files.RUN)})
    rows = [row for job_dir in job_dirs if (row := job_row(job_dir, sweep_dir)) is not None]
    rows.sort(key=lambda r: (r["job"] is None, r["job"] if r["job"] is not None else 0, r["dir"]))
    return rows


def is_run_dir(path: str | Path) -> bool:
    """A run's own directory (a job of a sweep included): run.json or job.json in it, not below it."""
    return (Path(path) / run_files.RUN).is_file() or (Path(path) / run_files.JOB).is_file()


def job_row(job_dir: Path, sweep_dir: Path) -> dict | None:
    """The summary row (COLUMNS) of one job or run directory; None when it holds neither job.json nor run.json."""
    job = read_json(job_dir / run_files.JOB)
    if job is None:
        run = read_json(job_dir / run_files.RUN)
        if run is None:
            return None
        job = {"overrides": run.get("overrides") or [], "status": run.get("status"), "error": run.get("error")}
    placement = run_placement(job_dir)
    if placement["placement"] is None and job.get("placement"):  # not run: as the launcher planned it
        placement = job["placement"]
    row = {
        "job": job.get("num"),
        "overrides": " ".join(job.get("swept") or job.get("overrides") or []),
        "status": job.get("status"),
        "exit_code": job.get("exit_code"),
        **placement,
        **run_summary(job_dir),
        "note": job.get("reason") or job.get("error"),
        "dir": str(job_dir.relative_to(sweep_dir)),
    }
    return {key: row.get(key) for key in COLUMNS}


def load_sweep(sweep_dir: str | Path, rows: list[dict] | None = None):
    """The sweep summary as a pandas DataFrame (one row per job, COLUMNS); `rows`: load_jobs' result, if at hand."""
    import pandas as pd

    return _numeric(pd.DataFrame(load_jobs(sweep_dir) if rows is None else rows, columns=list(COLUMNS)))


def _numeric(frame):
    """Number columns as numbers (NaN where a job has none), not objects holding None."""
    import pandas as pd

    for key in ("vllm_gpu_memory_utilization", *SUMMARY_KEYS, "reward"):
        frame[key] = pd.to_numeric(frame[key])
    for key in ("job", "exit_code", "world_size", "gpus", "vllm_tensor_parallel_size", "steps"):
        frame[key] = pd.to_numeric(frame[key]).astype("Int64")  # counts stay integers next to empty cells
    return frame


def write_summary(sweep_dir: str | Path, rows: list[dict] | None = None) -> Path:
    """Write SWEEP_DIR/summary.csv from the job directories (or load_jobs' `rows`); returns its path."""
    path = Path(sweep_dir) / run_files.SWEEP_SUMMARY
    load_sweep(sweep_dir, rows).to_csv(path, index=False)
    return path


def print_summary(sweep_dir: str | Path, file=None, rows: list[dict] | None = None) -> None:
    """Print the summary as a table (rich)."""
    rows = load_jobs(sweep_dir) if rows is None else rows
    counts = Counter(r["status"] for r in rows)
    _print_table(f"sweep {Path(sweep_dir).name}: " + ", ".join(f"{n} {s}" for s, n in counts.items()), rows, file)


def print_run(run_dir: str | Path, file=None) -> None:
    """Print one run directory's row of the summary table; nothing is written (summary.csv is a sweep's)."""
    run_dir = Path(run_dir)
    row = job_row(run_dir, run_dir)
    _print_table(f"{run_dir.resolve()}: {row['status']}", [row], file)
    print(f"{run_dir} is a run directory: nothing written (summary.csv is written for a sweep directory)", file=file)


def _print_table(title: str, rows: list[dict], file=None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for key, header in TABLE.items():
        table.add_column(header, overflow="fold", justify="left" if key in ("overrides", "status", "note") else "right")
    for r in rows:
        table.add_row(*(_cell(r[key], 160 if key == "note" else None) for key in TABLE))
    file = file or sys.stdout
    Console(file=file, width=None if file.isatty() else 200).print(table)


def missing(value) -> bool:
    """A cell without a value: None, NaN, or pandas' NA (the empty cell of an integer column)."""
    import pandas as pd

    return value is None or (pd.api.types.is_scalar(value) and bool(pd.isna(value)))


def _cell(value, max_chars: int | None = None) -> str:
    if isinstance(value, str) and max_chars and len(value) > max_chars:
        return value[: max_chars - 1] + "…"
    if missing(value):
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _select(data: dict, dotted: str):
    """data["a"]["b"] for "a.b"; None where a key is missing."""
    for key in dotted.split("."):
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def _read_yaml(path: Path) -> dict | None:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _number(value) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
