"""One run's per-step files as pandas frames: `load_run` (metrics.jsonl), `load_gpu_samples` (gpu_samples.jsonl) and
`load_phases` (phases.jsonl: what each rank did when)."""

from __future__ import annotations

from pathlib import Path

from colocated_grpo import run_files
from colocated_grpo.run_files import STEP_KEY, read_jsonl

# Columns of load_gpu_samples (one row per NVML sample) and load_phases (one row per phase interval of a rank).
SAMPLE_COLUMNS = (STEP_KEY, "rank", "phase", "t", "gpu", "util", "mem_gb", "power_w", "sm_clock_mhz")
PHASE_COLUMNS = (STEP_KEY, "rank", "phase", "start", "end")


def newest_dir(name: str) -> Path:
    """The most recently changed directory in NAME/ (`sweeps`, `outputs/runs`), here or one level up (notebooks/)."""
    for root in (Path(name), Path("..") / name):
        if dirs := [p for p in root.glob("*") if p.is_dir()]:
            return max(dirs, key=lambda p: p.stat().st_mtime)
    raise FileNotFoundError(f"no directory in {name}/ nor in ../{name}/: say which one to read")


def load_run(run_dir: str | Path):
    """metrics.jsonl as a DataFrame: one row per logged step, ordered by `train/global_step`, a column per metric."""
    import pandas as pd

    frame = pd.DataFrame(read_jsonl(Path(run_dir) / run_files.METRICS))
    if STEP_KEY not in frame:
        return pd.DataFrame(columns=[STEP_KEY])
    return frame.sort_values(STEP_KEY, kind="stable").reset_index(drop=True)


def load_gpu_samples(run_dir: str | Path):
    """gpu_samples.jsonl as a DataFrame (SAMPLE_COLUMNS): one row per NVML sample of a GPU, with the rank that took it
    and that rank's phase; `t` is the rank's time.perf_counter, as in load_phases. Empty without NVML (CPU)."""
    import pandas as pd

    frame = pd.DataFrame(read_jsonl(Path(run_dir) / run_files.GPU_SAMPLES), columns=list(SAMPLE_COLUMNS))
    frame["gpu"] = frame["gpu"].astype(str)
    return frame.sort_values(["rank", "t", "gpu"], kind="stable").reset_index(drop=True)


def load_phases(run_dir: str | Path):
    """Each rank's phase intervals (PHASE_COLUMNS), pieces merged: from phases.jsonl, else the samples' labels."""
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
    keys = p[["rank", "phase", STEP_KEY]]
    same = (keys == keys.shift()).all(axis=1) & (p["start"] <= p["end"].shift())
    merged = p.groupby((~same).cumsum(), sort=False).agg(
        {STEP_KEY: "first", "rank": "first", "phase": "first", "start": "min", "end": "max"}
    )
    return merged.reset_index(drop=True)[list(PHASE_COLUMNS)]


def phases_from_samples(samples):
    """Phase intervals from GPU samples' labels: each run of a rank's samples in one phase and step lasts from its
    first sample to the next run's, or, where the samples pause (time in no phase, between steps or while a
    checkpoint saves: no sample for more than one and a half intervals) and after the last run, to a sampling interval
    past its own last sample."""
    import pandas as pd

    spans = []
    for rank, own in samples.groupby("rank", sort=True):
        own = own.drop_duplicates("t").sort_values("t")  # one rank samples all its GPUs at one time
        interval = own["t"].diff().median() if len(own) > 1 else 0.0
        pause = 1.5 * interval  # longer without a sample: time in no phase
        paused = own["t"].diff() > pause
        first = (own[STEP_KEY] != own[STEP_KEY].shift()) | (own["phase"] != own["phase"].shift()) | paused
        last = own.groupby(first.cumsum())["t"].max().to_numpy()  # each run's last sample
        span = own[first].rename(columns={"t": "start"}).assign(rank=rank)
        following = span["start"].shift(-1)
        span["end"] = following.where(following - last <= pause, last + interval)
        spans.append(span[list(PHASE_COLUMNS)])
    return pd.concat(spans, ignore_index=True) if spans else pd.DataFrame(columns=list(PHASE_COLUMNS))
