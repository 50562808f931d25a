"""The figures researchers look at: a sweep's (sweep_figures, from tables.load_sweep) and a run's (run_figures, from
frames.load_run, load_gpu_samples and load_phases).

Every function returns a matplotlib Figure (no pyplot state; a notebook cell ending in one shows it) and draws a
note where data is missing (no NVML, no server job, a sparse grid). The notebooks and `render DIR` call them.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from colocated_grpo import run_files
from colocated_grpo.analysis import frames, tables
from colocated_grpo.run_files import STEP_KEY
from colocated_grpo.telemetry.phases import PHASES

PHASE_COLORS = {
    "generate": "#4C72B0",
    "sync_weights": "#8172B3",
    "sleep_wake": "#C44E52",
    "reward": "#55A868",
    "train": "#DD8452",
    "other": "#B0B0B0",
}
COLOCATED = ("colocate", "colocate_sleep")
PLACEMENT_ORDER = {"colocate": 0, "colocate_sleep": 1, "server": 2, "none": 3}  # the bars' order; others last
TP, MEMORY = "vllm_tensor_parallel_size", "vllm_gpu_memory_utilization"
FAIRNESS_NOTE = (
    "Per GPU used counts the vLLM server's GPUs too: the same hardware on both sides, the fair comparison.\n"
    "Per training GPU leaves the server's GPUs out (the usual N/(N-K) scaling), which flatters server mode."
)
NO_NVML = "no GPU samples (no NVML)"


# ------------------------------------------------------------------------------------------------------- sweep


def throughput_heatmap(jobs, metric: str = "perf/tokens_per_s_per_gpu", higher_is_better: bool | None = None) -> Figure:
    """`metric` of the finished colocated jobs over vLLM TP (rows) × gpu_memory_utilization (columns): the mean per
    cell, the best one framed (highest; lowest for times and memory unless `higher_is_better` says)."""
    if higher_is_better is None:
        higher_is_better = not metric.startswith(("timing_s/", "memory/"))
    grid = jobs[jobs["placement"].isin(COLOCATED) & jobs[TP].notna() & jobs[MEMORY].notna()]
    placements = [p for p in COLOCATED if p in set(grid["placement"])]
    fig = Figure(figsize=(1.5 + 4.5 * max(1, len(placements)), 4.0), layout="constrained")
    if not placements:
        _note(fig.subplots(), "no colocated vLLM jobs with a TP size and gpu_memory_utilization in this sweep")
        return fig
    for ax, placement in zip(fig.subplots(1, len(placements), squeeze=False)[0], placements, strict=True):
        sub = grid[grid["placement"] == placement]
        finished = sub[metric].where(sub["status"] == "finished")  # only finished jobs' values count
        cells = sub.assign(value=finished).groupby([sub[TP].astype(int), sub[MEMORY].astype(float)])
        stats = cells.agg(mean=("value", "mean"), count=("value", "count"), statuses=("status", _statuses))
        means = stats["mean"].unstack()
        labels = stats.apply(_cell_label, axis=1).unstack(fill_value="")  # a cell with no job stays blank
        values = means.to_numpy(float)
        image = ax.imshow(values, cmap=colormaps["viridis"].with_extremes(bad="#EEEEEE"), origin="lower", aspect="auto")
        for (i, j), label in np.ndenumerate(labels.to_numpy()):
            ax.text(j, i, label, ha="center", va="center", fontsize=9, color=_text_color(image, values[i, j]))
        if not np.isnan(values).all():
            best = np.nanargmax(values) if higher_is_better else np.nanargmin(values)
            i, j = np.unravel_index(best, values.shape)
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5))
            fig.colorbar(image, ax=ax, label=metric)
        ax.set_xticks(range(len(means.columns)), [f"{m:g}" for m in means.columns])
        ax.set_yticks(range(len(means.index)), [str(t) for t in means.index])
        ax.set(xlabel="vllm_gpu_memory_utilization", ylabel="vllm_tensor_parallel_size")
        ax.set_title(f"{placement}: {metric}", fontsize=10)
    return fig


def step_breakdown(jobs) -> Figure:
    """Each job's steady-state step time as a bar stacked by phase (timing_s/<phase>); a job whose run logged no
    phase timings gets one grey bar of its step time; a job that did not finish says so in its label."""
    done = jobs[jobs["timing_s/step"].notna()].reset_index(drop=True)
    fig = Figure(figsize=(9.0, 1.6 + 0.45 * max(1, len(done))), layout="constrained")
    ax = fig.subplots()
    if done.empty:
        _note(ax, "no job with step timings in this sweep")
        return fig
    labels = [
        _job_label(row) + ("" if row["status"] == "finished" else f" ({row['status']})") for _, row in done.iterrows()
    ]
    _stack_phases(ax, done, labels)
    ax.set_title("step time by phase")
    return fig


def peak_memory(jobs) -> Figure:
    """Peak GPU memory (memory/peak_gb) against vLLM's gpu_memory_utilization, one line per placement and TP."""
    done = jobs[(jobs["status"] == "finished") & jobs[MEMORY].notna()]
    measured = done[done["memory/peak_gb"].notna()]
    fig = Figure(figsize=(6.5, 4.0), layout="constrained")
    ax = fig.subplots()
    if measured.empty:
        _note(ax, f"{NO_NVML}: no memory to plot" if len(done) else "no finished job with a gpu_memory_utilization")
        return fig
    for (placement, tp), line in measured.groupby(["placement", TP], sort=True):
        line = line.groupby(MEMORY)["memory/peak_gb"].mean().sort_index()
        ax.plot(line.index, line.values, marker="o", label=f"{placement}, TP {int(tp)}")
    ax.set(xlim=(0, 1), ylim=(0, None), xlabel="vllm_gpu_memory_utilization", ylabel="peak GPU memory (GB, any GPU)")
    ax.set_title("peak memory vs gpu_memory_utilization")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def colocate_vs_server(jobs) -> Figure:
    """The best finished job of each placement (by tokens/s per GPU used) in tokens/s per GPU used and per training
    GPU, with the colocated-over-server speed-up in both and the note on which one is fair."""
    done = jobs[(jobs["status"] == "finished") & jobs["perf/tokens_per_s_per_gpu"].notna()]
    fig = Figure(figsize=(8.0, 5.0), layout="constrained")
    ax, text = fig.subplots(2, 1, height_ratios=[6, 1])
    text.axis("off")
    if done.empty:
        _note(ax, "no finished job with throughput in this sweep")
        return fig
    best = done.loc[done.groupby("placement")["perf/tokens_per_s_per_gpu"].idxmax()]
    best = best.sort_values("placement", key=lambda p: p.map(PLACEMENT_ORDER)).reset_index(drop=True)
    per_gpu = best["perf/tokens_per_s_per_gpu"]
    per_train = best["perf/tokens_per_s_per_train_gpu"].fillna(best["perf/tokens_per_s"] / best["world_size"])
    x = range(len(best))
    ax.bar([i - 0.2 for i in x], per_gpu, width=0.4, label="per GPU used", color="#4C72B0")
    ax.bar([i + 0.2 for i in x], per_train, width=0.4, label="per training GPU", color="#DD8452")
    ax.set_xticks(list(x), [f"{r['placement']}\n{_gpus(r)}\n{_job_label(r)}" for _, r in best.iterrows()], fontsize=8)
    ax.set(xlim=(-0.8, len(best) - 0.2), ylabel="tokens/s")
    ax.legend(fontsize=8)
    server = best[best["placement"] == "server"]
    colocated = best[best["placement"].isin(COLOCATED)]
    if server.empty or colocated.empty:
        ax.set_title("best job per placement")
        missing = "server" if server.empty else "colocated"
        note = f"no {missing} jobs in this sweep: no colocate-vs-server speed-up to show.\n"
    else:
        c, s = colocated.loc[colocated["perf/tokens_per_s_per_gpu"].idxmax()], server.iloc[0]
        ax.set_title(
            f"{c['placement']} vs server: {c['perf/tokens_per_s_per_gpu'] / s['perf/tokens_per_s_per_gpu']:.2f}× "
            f"per GPU used, {per_train[c.name] / per_train[s.name]:.2f}× per training GPU"
        )
        note = ""
    text.text(0, 1, note + FAIRNESS_NOTE, va="top", fontsize=8)
    return fig


def sweep_figures(jobs) -> dict[str, Figure]:
    """Every sweep figure, by name (the PNG's file name)."""
    return {plot.__name__: plot(jobs) for plot in (throughput_heatmap, step_breakdown, peak_memory, colocate_vs_server)}


# --------------------------------------------------------------------------------------------------------- run


def study_figure(table) -> Figure:
    """A study's results (bench.study COLUMNS), per model, its cases in the order the study lists them: each case's
    step time by phase and tokens/s per GPU, with the lowest and highest of its repeats as error bars, and speed-up."""
    models = list(dict.fromkeys(table["model"]))
    fig = Figure(figsize=(13.0, 1.2 + 0.42 * len(table)), layout="constrained")
    heights = [max(1, (table["model"] == m).sum()) for m in models] or [1]
    axes = fig.subplots(len(heights), 2, squeeze=False, height_ratios=heights)
    for (left, right), model in zip(axes, models, strict=False):
        done = table[(table["model"] == model) & table["step_s"].notna()].reset_index(drop=True)
        if done.empty:
            _note(left, f"{model}: no case finished")
            right.set_axis_off()
            continue
        frame = done.rename(columns={f"{p}_s": f"timing_s/{p}" for p in (*PHASES, "step")})
        labels = [
            f"{case} (plain TRL)" if kind == "plain_trl" else case
            for case, kind in zip(done["case"], done.get("kind", ["ours"] * len(done)), strict=True)
        ]
        _stack_phases(left, frame, labels, spread=_spread(done, "step_s"))
        left.set_title(f"{model}: step time by phase" + _runs(done), fontsize=10)
        positions = list(range(len(done)))
        rates = done["tokens_per_s_per_gpu"]
        right.barh(positions, rates, 0.6, color="#4C72B0")
        ends = rates
        if (spread := _spread(done, "tokens_per_s_per_gpu")) is not None:
            _error_bars(right, positions, rates, spread)
            ends = spread[1]
        for position, (end, rate, speedup) in enumerate(zip(ends, rates, done["speedup_vs_baseline"], strict=True)):
            label = f"{rate:,.0f}" + ("" if tables.missing(speedup) else f"  ({speedup:.2f}×)")
            _annotate(right, label, (end, position), (3, 0), va="center", fontsize=8)
        right.set_yticks(positions, [""] * len(positions))
        right.invert_yaxis()
        right.margins(x=0.25)
        right.set_xlabel("tokens/s per GPU used (speed-up over the baseline)")
        right.set_title(f"{model}: throughput", fontsize=10)
    return fig


def _spread(done, key: str):
    """(lowest, highest) repeat means of `key` per row, the mean where a row has none; None when no row has two
    repeats (nothing to draw)."""
    low, high = f"{key}_spread_min", f"{key}_spread_max"
    if low not in done or (done[high] - done[low]).fillna(0).eq(0).all():
        return None
    return done[low].fillna(done[key]).to_numpy(float), done[high].fillna(done[key]).to_numpy(float)


def _error_bars(ax, positions, values, spread) -> None:
    low, high = spread
    values = np.asarray(values, float)
    ax.errorbar(values, positions, xerr=[values - low, high - values], fmt="none", ecolor="black", capsize=3, lw=1)


def _runs(done) -> str:
    most = done["repeats"].max() if "repeats" in done else None
    return f" (bars: lowest–highest of {most:.0f} runs)" if most and most > 1 else ""


def gpu_timeline(samples, phases, steps: tuple[int, int] | None = None) -> Figure:
    """One panel per GPU: NVML utilisation (and memory, dashed) over time, shaded by the phases of the rank that
    sampled it, thin lines where steps begin; without samples (no NVML), each rank's phases alone with the note.
    `steps=(first, last)`: only those train/global_steps (a long run is too dense to read whole)."""
    if steps is not None:
        samples = samples[samples[STEP_KEY].between(*steps)]
        phases = phases[phases[STEP_KEY].between(*steps)]
    origin = min([*samples["t"], *phases["start"]], default=0.0)  # the first moment either saw
    rows = _gpu_order(samples["gpu"].unique()) if len(samples) else sorted(phases["rank"].unique())
    fig = Figure(figsize=(11.0, 1.0 + 1.8 * max(1, len(rows))), layout="constrained")
    if not rows:
        _note(fig.subplots(), f"{NO_NVML} and no phase timings in this run")
        return fig
    axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False)[:, 0]
    starts = phases.groupby(STEP_KEY)["start"].min() - origin
    for ax, row in zip(axes, rows, strict=True):
        if len(samples):
            gpu = samples[samples["gpu"] == row]
            rank = gpu["rank"].mode().iloc[0]
            _shade_phases(ax, phases[phases["rank"] == rank], origin, 100)
            ax.plot(gpu["t"] - origin, gpu["util"], drawstyle="steps-post", color="black", linewidth=1)
            ax.set(ylim=(0, 105), ylabel=f"GPU {row}\nutil %")
            memory = ax.twinx()
            memory.plot(gpu["t"] - origin, gpu["mem_gb"], color="#C44E52", linestyle="--", linewidth=1)
            memory.set_ylim(0, max(1.0, gpu["mem_gb"].max() * 1.1))
            memory.set_ylabel("GB", color="#C44E52")
        else:
            _shade_phases(ax, phases[phases["rank"] == row], origin, 1)
            ax.set_yticks([])
            ax.set_ylabel(f"rank {row}")
        for start in starts:
            ax.axvline(start, color="#444444", linewidth=0.6, alpha=0.6)
    for step, start in starts.iloc[:: max(1, len(starts) // 30)].items():  # at most ~30 step numbers on top
        _annotate(axes[0], str(step), (start, 1), (2, 2), xycoords=("data", "axes fraction"), fontsize=7, va="bottom")
    handles = [Patch(color=PHASE_COLORS[p], alpha=0.5, label=p) for p in PHASES if p in set(phases.get("phase", []))]
    if len(samples):
        util = Line2D([], [], color="black", label="util %")
        handles += [util, Line2D([], [], color="#C44E52", linestyle="--", label="memory GB")]
        title = "GPU utilisation per GPU, phases shaded (step numbers on top)"
    else:
        title = f"{NO_NVML}: the phases of each rank (step numbers on top)"
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8)
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    axes[-1].set_xlabel("seconds since the first step began")
    return fig


def training_curves(metrics) -> Figure:
    """Reward (± std) and each reward function's mean, and completion length (min–max band), by global step."""
    fig = Figure(figsize=(8.0, 6.0), layout="constrained")
    reward_ax, length_ax = fig.subplots(2, 1, sharex=True)
    step = metrics[STEP_KEY]
    if "reward" in metrics:
        reward_ax.plot(step, metrics["reward"], marker="o", color="black", label="reward")
        if "reward_std" in metrics:
            low, high = metrics["reward"] - metrics["reward_std"], metrics["reward"] + metrics["reward_std"]
            reward_ax.fill_between(step, low, high, color="black", alpha=0.1, label="reward ± std")
        for column in sorted(c for c in metrics.columns if c.startswith("rewards/") and c.endswith("/mean")):
            name = column.removeprefix("rewards/").removesuffix("/mean")
            reward_ax.plot(step, metrics[column], marker=".", label=name)
        reward_ax.legend(fontsize=8)
    else:
        _note(reward_ax, "no reward logged")
    reward_ax.set_ylabel("reward")
    reward_ax.grid(alpha=0.3)
    if "completions/mean_length" in metrics:
        length_ax.plot(step, metrics["completions/mean_length"], marker="o", label="mean")
        if {"completions/min_length", "completions/max_length"} <= set(metrics.columns):
            length_ax.fill_between(
                step, metrics["completions/min_length"], metrics["completions/max_length"], alpha=0.2, label="min–max"
            )
        length_ax.legend(fontsize=8)
    else:
        _note(length_ax, "no completion lengths logged")
    length_ax.set(ylabel="completion length (tokens)", xlabel=STEP_KEY)
    length_ax.grid(alpha=0.3)
    return fig


def step_phases(metrics) -> Figure:
    """Each step's time as a bar stacked by phase (timing_s/<phase>)."""
    fig = Figure(figsize=(8.0, 4.0), layout="constrained")
    ax = fig.subplots()
    if "timing_s/step" not in metrics or metrics["timing_s/step"].isna().all():
        _note(ax, "no step timings logged (telemetry off?)")
        return fig
    _stack_phases(ax, metrics[metrics["timing_s/step"].notna()])
    ax.set_title("step time by phase")
    return fig


def run_figures(metrics, samples, phases) -> dict[str, Figure]:
    """Every run figure, by name (the PNG's file name)."""
    return {
        "gpu_timeline": gpu_timeline(samples, phases),
        "training_curves": training_curves(metrics),
        "step_phases": step_phases(metrics),
    }


# ------------------------------------------------------------------------------------------------ to PNG files


def save(figures: dict[str, Figure], out_dir: str | Path) -> list[Path]:
    """Write each figure as OUT_DIR/<name>.png; returns the paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, fig in figures.items():
        fig.savefig(out_dir / f"{name}.png", dpi=120)
    return [out_dir / f"{name}.png" for name in figures]


class Figures(dict):
    """Figures by name that are also written as OUT_DIR/<name>.png as they are added, when `out_dir` is set: a
    notebook's cells `figures.add(name, fig)`, which returns the figure for the notebook to show."""

    def __init__(self, out_dir: str | Path | None = None):
        super().__init__()
        self.out_dir = out_dir

    def add(self, name: str, fig: Figure) -> Figure:
        self[name] = fig
        if self.out_dir:
            save({name: fig}, self.out_dir)
        return fig


def render(path: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """A sweep's (sweep_figures) or a run's (run_figures) figures as PNGs in `out_dir` (default: PATH/figures)."""
    path = Path(path)
    if (path / run_files.METRICS).exists() or (path / run_files.RUN).exists():
        figures = run_figures(frames.load_run(path), frames.load_gpu_samples(path), frames.load_phases(path))
    elif any(path.glob(f"*/{run_files.JOB}")) or any(path.glob("*/run.json")):
        figures = sweep_figures(tables.load_sweep(path))
    else:
        raise SystemExit(f"{path}: neither a run directory (run.json) nor a sweep directory (job directories)")
    return save(figures, out_dir or path / "figures")


# ----------------------------------------------------------------------------------------------------- helpers


def _stack_phases(ax, frame, labels=None, spread=None) -> None:
    """A bar per row stacked by phase (timing_s/<phase>), the total (timing_s/step) written at its end, a row without
    phase timings one grey bar. With `labels`: horizontal bars so named (steady state); else at each global step.
    `spread`: (lowest, highest) of each horizontal bar's total, drawn as error bars."""
    horizontal = labels is not None
    positions = list(range(len(frame))) if horizontal else frame[STEP_KEY].tolist()
    bar = ax.barh if horizontal else ax.bar
    parts = frame.reindex(columns=[f"timing_s/{phase}" for phase in PHASES]).fillna(0.0).to_numpy(float)
    base = np.zeros(len(frame))
    for phase, part in zip(PHASES, parts.T, strict=True):
        if part.any():
            bar(positions, part, 0.6, base, color=PHASE_COLORS[phase], label=phase)
            base = base + part
    total = frame["timing_s/step"].to_numpy(float)
    unsplit = np.where(base == 0, total, 0.0)
    if unsplit.any():
        bar(positions, unsplit, 0.6, color="#DDDDDD", hatch="//", label="step (no phase timings)")
    ends = total
    if spread is not None:
        _error_bars(ax, positions, total, spread)
        ends = spread[1]
    for position, value, end in zip(positions, total, ends, strict=True):
        if horizontal:
            _annotate(ax, f"{value:.3g} s", (end, position), (3, 0), va="center", ha="left", fontsize=8)
        else:
            _annotate(ax, f"{value:.3g} s", (position, value), (0, 3), va="bottom", ha="center", fontsize=8)
    if horizontal:
        ax.margins(x=0.12)
        ax.set_yticks(positions, labels)
        ax.invert_yaxis()
        ax.set_xlabel("seconds per step (steady state)")
    else:
        ax.margins(y=0.12)
        ax.set(xlabel=STEP_KEY, ylabel="seconds")
    ax.legend(fontsize=8, loc="best")


def _shade_phases(ax, phases, origin: float, height: float) -> None:
    for phase in PHASES:
        spans = phases[phases["phase"] == phase]
        if len(spans):
            xranges = list(zip(spans["start"] - origin, spans["end"] - spans["start"], strict=True))
            ax.broken_barh(xranges, (0, height), facecolors=PHASE_COLORS[phase], alpha=0.35, linewidth=0)


def _annotate(ax, text: str, xy, offset: tuple[int, int], **kwargs) -> None:
    """`text` at `offset` points from `xy`."""
    ax.annotate(text, xy, xytext=offset, textcoords="offset points", **kwargs)


def _note(ax, text: str) -> None:
    """A message in place of a plot."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=10, color="#555555", wrap=True)
    ax.set_xticks([])
    ax.set_yticks([])


def _text_color(image, value: float) -> str:
    """Black on a light cell, white on a dark one, grey on an empty one."""
    if math.isnan(value):
        return "#555555"
    r, g, b, _ = image.cmap(image.norm(value))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "white"


def _cell_label(cell) -> str:
    """A heatmap cell's text: the mean of its finished jobs, or why it has none (skipped, failed, no data)."""
    if not cell["count"]:
        return cell["statuses"]
    text = f"{cell['mean']:,.0f}" if abs(cell["mean"]) >= 100 else f"{cell['mean']:.3g}"
    return text + (f"\n(mean of {cell['count']})" if cell["count"] > 1 else "")


def _statuses(status) -> str:
    """A cell's job statuses, one a line ("no data" for finished jobs without the metric), or "?"."""
    return "\n".join("no data" if s == "finished" else s for s in sorted(set(status.dropna()))) or "?"


_SHORT = {
    "vllm_tensor_parallel_size": "TP",
    "vllm_gpu_memory_utilization": "mem",
    "per_device_train_batch_size": "bs",
    "nproc_per_node": "nproc",
}


def _job_label(row) -> str:
    """'#3 TP=2 mem=0.3' from a job's number and swept overrides (keys shortened)."""
    parts = []
    for override in str(row.get("overrides") or "").split():
        key, _, value = override.partition("=")
        name = key.lstrip("+~").rsplit(".", 1)[-1]
        parts.append(f"{_SHORT.get(name, name)}={value}")
    number = row.get("job")
    head = f"#{int(number)}" if not tables.missing(number) else ""
    return " ".join([head, *parts]).strip() or str(row.get("dir") or "job")


def _gpus(row) -> str:
    train, used = row.get("world_size"), row.get("gpus")
    if tables.missing(train) or tables.missing(used):
        return ""
    return f"{int(train)} train + {int(used) - int(train)} serve GPUs"


def _gpu_order(labels) -> list[str]:
    """GPU labels with the ranks' ("0", "1", …) first in numeric order, then the server's ("server0", …)."""
    return sorted(labels, key=lambda g: (not str(g).isdigit(), int(g) if str(g).isdigit() else 0, str(g)))
