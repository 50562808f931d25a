"""One run's per-step files as pandas frames, for notebooks, figures and tests: `load_run` (metrics.jsonl),
`load_gpu_samples` (gpu_samples.jsonl) and `load_phases` (phases.jsonl: what each rank did when)."""

from __future__ import annotations

from pathlib import Path

from colocated_grpo import run_files
from colocated_grpo.run_files import STEP_KEY, read_jsonl

# Columns of load_gpu_samples (one row per NVML sample) and load_phases (one row per phase interval of a rank).
SAMPLE_COLUMNS = (STEP_KEY, "rank", "phase", "t", "gpu", "util", "mem_gb", "power_w", "sm_clock_mhz")
PHASE_COLUMNS = (STEP_KEY, "rank", "phase", "start", "end")


def newest_dir(name: str) -> Path:
    """The most recently changed directory in NAME/ (`sweeps`, `outputs/runs`), looked for in the current directory
    and one level up (a notebook runs in notebooks/)."""
    for root in (Path(name), Path("..") / name):
        dirs = [p for p in root.glob("*") if p.is_dir()]
        if dirs:
            return max(dirs, key=lambda p: p.stat().st_mtime)
    raise FileNotFoundError(f"no directory in {name}/ nor in ../{name}/: say which one to read")


def load_run(run_dir: str | Path):
    """metrics.jsonl as a DataFrame: one row per logged step, ordered by `train/global_step`, one column per metric
    (TRL's, e.g. `reward`, `rewards/<name>/mean`, `completions/mean_length`, and the telemetry's)."""
    import pandas as pd

    path = Path(run_dir) / run_files.METRICS
    frame = pd.DataFrame(read_jsonl(path))
    if STEP_KEY not in frame:
        return pd.DataFrame(columns=[STEP_KEY])
    return frame.sort_values(STEP_KEY, kind="stable").reset_index(drop=True)


def load_gpu_samples(run_dir: str | Path):
    """gpu_samples.jsonl as a DataFrame (SAMPLE_COLUMNS): one row per NVML sample of a GPU, labelled with the rank
    that took it and the phase that rank was in. `t` is that rank's clock (time.perf_counter), like load_phases'.
    Empty (with the columns) when there were no samples: no NVML, e.g. on CPU."""
    import pandas as pd

    path = Path(run_dir) / run_files.GPU_SAMPLES
    frame = pd.DataFrame(read_jsonl(path), columns=list(SAMPLE_COLUMNS))
    frame["gpu"] = frame["gpu"].astype(str)
    return frame.sort_values(["rank", "t", "gpu"], kind="stable").reset_index(drop=True)


def load_phases(run_dir: str | Path):
    """What each rank did when: one row per phase interval (PHASE_COLUMNS), adjacent pieces of one phase merged.

    From phases.jsonl (exact phase edges) when the run wrote it; else derived from the GPU samples' phase labels
    (phases_from_samples), for runs from before phases.jsonl existed. Empty when there is neither.
    """
    import pandas as pd

    path = Path(run_dir) / run_files.PHASES
    if path.exists():
        return merge_phases(pd.DataFrame(read_jsonl(path), columns=list(PHASE_COLUMNS)))
    return phases_from_samples(load_gpu_samples(run_dir))


def merge_phases(phases):
    """Join each rank's back-to-back intervals of the same phase and step into one."""
    if phases.empty:
        return phases.reset_index(drop=True)
    p = phases.sort_values(["rank", "start"], kind="stable").reset_index(drop=True)
    same = (
        (p["rank"] == p["rank"].shift())
        & (p["phase"] == p["phase"].shift())
        & (p[STEP_KEY] == p[STEP_KEY].shift())
        & (p["start"] <= p["end"].shift())
    )
    merged = p.groupby((~same).cumsum(), sort=False).agg(
        {STEP_KEY: "first", "rank": "first", "phase": "first", "start": "min", "end": "max"}
    )
    return merged.reset_index(drop=True)[list(PHASE_COLUMNS)]


def phases_from_samples(samples):
    """Phase intervals from the phase labels of GPU samples: each run of consecutive samples of one rank in the same
    phase and step becomes an interval from its first sample to the next run's first sample (the last one ends a
    sampling interval after its last sample). As coarse as the sampling interval."""
    import pandas as pd

    rows = []
    for rank, group in samples.groupby("rank", sort=True):
        g = group.drop_duplicates("t").sort_values("t")  # one rank samples all its GPUs at one time
        t = g["t"].to_numpy()
        interval = float(pd.Series(t).diff().median()) if len(t) > 1 else 0.0
        key = list(zip(g[STEP_KEY], g["phase"], strict=True))
        start = 0
        for i in range(1, len(t) + 1):
            if i == len(t) or key[i] != key[start]:
                end = t[i] if i < len(t) else t[i - 1] + interval
                rows.append(
                    {
                        STEP_KEY: key[start][0],
                        "rank": rank,
                        "phase": key[start][1],
                        "start": float(t[start]),
                        "end": float(end),
                    }
                )
                start = i
    return pd.DataFrame(rows, columns=list(PHASE_COLUMNS))
