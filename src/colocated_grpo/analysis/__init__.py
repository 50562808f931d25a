"""Runs and sweeps as tables, frames and figures (pandas, matplotlib), for notebooks and the render command.

tables     one row per run or sweep job: placement beside steady-state numbers; the sweep summary
frames     one run's steps, GPU samples and phase intervals
wandb_api  the same, from the W&B API
plots      the figures (needs the `notebooks` extra: matplotlib)
notebook   run a notebook headless with parameters
"""

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
