# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # A run: what the GPUs did, and what the policy learned
#
# Read from a run directory (`outputs/runs/<time>_<name>`, or a job directory of a sweep): `metrics.jsonl` per
# step, `gpu_samples.jsonl` per NVML sample, `phases.jsonl` per phase of each rank. With `wandb_run`, the metrics
# come from the W&B API instead (the GPU samples are only in the run directory). Execute headless:
#
# ```bash
# python -m colocated_grpo.analysis.notebook notebooks/run.py run_dir=outputs/runs/<time>_<name> -o run.executed.ipynb
# python -m colocated_grpo.analysis render outputs/runs/<time>_<name>     # the same figures as PNGs
# ```

# %% tags=["parameters"]
run_dir = None  # a run directory; None: the newest one in outputs/runs/
wandb_run = None  # "entity/project/run_id": read the metrics from the W&B API instead of run_dir
timeline_steps = None  # (first, last): the GPU timeline of these train/global_steps only; None: all
figures_dir = None  # also write the figures there as PNGs

# %%
# %matplotlib inline
import pandas as pd

from colocated_grpo import analysis
from colocated_grpo.analysis import plots

if wandb_run:
    metrics = analysis.load_wandb_run(wandb_run)
    samples = pd.DataFrame(columns=list(analysis.SAMPLE_COLUMNS))
    phases = pd.DataFrame(columns=list(analysis.PHASE_COLUMNS))
    summary = analysis.summary_row({}, metrics.to_dict("records"))
else:
    run_dir = run_dir or analysis.newest_dir("outputs/runs")
    metrics = analysis.load_run(run_dir)
    samples = analysis.load_gpu_samples(run_dir)
    phases = analysis.load_phases(run_dir)
    summary = {**analysis.run_placement(run_dir), **analysis.run_summary(run_dir)}
figures = plots.Figures(figures_dir)  # written as PNGs to figures_dir, when set
pd.Series(summary, name="steady state").to_frame()

# %% [markdown]
# ## GPU utilisation over time, phases shaded
#
# One panel per GPU (a vLLM server's included): NVML utilisation (the share of time a kernel ran) and memory,
# over the phases of the rank that sampled it. Without NVML (CPU) only the phases of each rank are drawn.

# %%
figures.add("gpu_timeline", plots.gpu_timeline(samples, phases, steps=timeline_steps))

# %% [markdown]
# ## Rewards and completion lengths

# %%
figures.add("training_curves", plots.training_curves(metrics))

# %% [markdown]
# ## Step time by phase

# %%
figures.add("step_phases", plots.step_phases(metrics))
