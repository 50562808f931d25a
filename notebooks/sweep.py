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
# # A sweep: which placement, and where does the time go?
#
# One row per job of a sweep (`python train.py -m … +sweep=…`), read from the sweep directory (the run files are
# the source of truth) or, with `wandb_project`, from the W&B API. Set the parameters below, or execute headless:
#
# ```bash
# python -m colocated_grpo.analysis.notebook notebooks/sweep.py sweep_dir=sweeps/<time>_<name> -o sweep.executed.ipynb
# python -m colocated_grpo.analysis render sweeps/<time>_<name>     # the same figures as PNGs, no notebook
# ```

# %% tags=["parameters"]
sweep_dir = None  # a sweep directory; None: the newest one in sweeps/
wandb_project = None  # "entity/project": read the runs from the W&B API instead of sweep_dir
wandb_group = None  # with wandb_project: the sweep's W&B group (by default the sweep directory's name)
figures_dir = None  # also write the figures there as PNGs

# %%
# %matplotlib inline
from colocated_grpo import analysis
from colocated_grpo.analysis import plots

if wandb_project:
    jobs = analysis.load_wandb_sweep(wandb_project, wandb_group)
else:
    sweep_dir = sweep_dir or analysis.newest_dir("sweeps")
    jobs = analysis.load_sweep(sweep_dir)
figures = plots.Figures(figures_dir)  # written as PNGs to figures_dir, when set
jobs[
    [
        "job",
        "overrides",
        "status",
        *analysis.PLACEMENT_KEYS,
        "timing_s/step",
        "perf/tokens_per_s_per_gpu",
        "memory/peak_gb",
        "reward",
        "note",
    ]
]

# %% [markdown]
# ## Throughput over vLLM TP × gpu_memory_utilization
#
# Tokens/s per GPU of the finished colocated jobs (steady state, first steps left out); the best cell is framed.
# Cells that did not run say why (skipped, failed); blank cells had no job.

# %%
figures.add("throughput_heatmap", plots.throughput_heatmap(jobs, metric="perf/tokens_per_s_per_gpu"))

# %% [markdown]
# ## Where each job's step time goes
#
# `timing_s/<phase>`: the phases tile the step (sync_weights runs inside generation and is counted apart).

# %%
figures.add("step_breakdown", plots.step_breakdown(jobs))

# %% [markdown]
# ## Peak memory against gpu_memory_utilization
#
# `memory/peak_gb` is the highest NVML memory use of any GPU in a step; without NVML (CPU) there is none.

# %%
figures.add("peak_memory", plots.peak_memory(jobs))

# %% [markdown]
# ## Colocate vs server
#
# The best job of each placement. Tokens/s **per GPU used** counts the server's GPUs and is the fair comparison;
# **per training GPU** leaves them out (N/(N−K) scaling) and flatters server mode, so both are shown.

# %%
figures.add("colocate_vs_server", plots.colocate_vs_server(jobs))
