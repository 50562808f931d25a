"""Runs and sweeps as tables (`tables`; `wandb_api` from the W&B API), frames (`frames`) and figures (`plots`, with
the `notebooks` extra), for notebooks and the render command; `notebook` runs a notebook headless with parameters."""

from colocated_grpo.analysis.frames import (
    PHASE_COLUMNS,
    SAMPLE_COLUMNS,
    load_gpu_samples,
    load_phases,
    load_run,
    newest_dir,
)
from colocated_grpo.analysis.tables import PLACEMENT_KEYS, load_sweep, run_placement, run_summary, summary_row
from colocated_grpo.analysis.wandb_api import load_wandb_run, load_wandb_sweep

__all__ = [
    "PHASE_COLUMNS",
    "PLACEMENT_KEYS",
    "SAMPLE_COLUMNS",
    "load_gpu_samples",
    "load_phases",
    "load_run",
    "load_sweep",
    "load_wandb_run",
    "load_wandb_sweep",
    "newest_dir",
    "run_placement",
    "run_summary",
    "summary_row",
]
