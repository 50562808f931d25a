"""The analysis frames, the figures, the notebooks (executed headless) and the render command, on the files of a
real tiny run (2 ranks, made by conftest) and of a real GPU sweep kept in the repo."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import jupytext
import nbformat
import numpy as np
import pandas as pd
import pytest
import yaml
from matplotlib.collections import PolyCollection
from matplotlib.image import imread

from colocated_grpo import analysis, run_files
from colocated_grpo.analysis import frames, notebook, plots, tables
from colocated_grpo.run_files import read_json, read_jsonl
from colocated_grpo.telemetry import aggregate
from colocated_grpo.telemetry.nvml import Sample
from colocated_grpo.telemetry.phases import PHASES, Segment

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"

# A sweep kept in sweeps/results: 2 H200s, Qwen2.5-1.5B shapes, TP 1 and 2 × gpu_memory_utilization 0.3, 0.5, 0.7,
# with NVML samples. Ctrl-C stopped it in its fifth job (interrupted), so the sixth never ran (cancelled): the grid
# the figures get has a cell that failed and one that is empty.
KEPT_SWEEP = REPO / "sweeps" / "results" / "tp_x_gpu_mem_1.5b" / "tp1_tp2_first_run"


STEPS = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def run_dir(tp2_run) -> Path:
    """conftest's run of 2 ranks (torchrun, TP 2), whose phases.jsonl holds both ranks' phases of 4 steps."""
    return tp2_run.dir


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    """A copy of KEPT_SWEEP (render writes its figures into the sweep directory)."""
    copy = tmp_path_factory.mktemp("sweep") / KEPT_SWEEP.name
    shutil.copytree(KEPT_SWEEP, copy)
    return copy


def no_gpu() -> bool:
    import torch

    return not torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------- run frames


def test_load_run_is_one_row_per_step_with_trl_and_telemetry_metrics(run_dir):
    metrics = analysis.load_run(run_dir)
    assert list(metrics["train/global_step"]) == STEPS
    expected = {
        "reward",
        "reward_std",
        "rewards/exact_answer/mean",
        "rewards/boxed_format/mean",
        "rewards/length/mean",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "loss",
        *(f"timing_s/{p}" for p in (*PHASES, "step")),
        "perf/tokens_per_s",
        "perf/tokens_per_s_per_gpu",
    }
    assert expected <= set(metrics.columns)
    assert metrics["reward"].between(-1, 2).all() and metrics["reward"].notna().all()
    assert metrics["completions/mean_length"].between(1, 32).all(), "trainer/tiny: max_completion_length 32"
    phases = metrics[[f"timing_s/{p}" for p in PHASES]].sum(axis=1)
    np.testing.assert_allclose(phases, metrics["timing_s/step"], rtol=1e-6)
    assert (metrics["perf/tokens_per_s"] > 0).all()


def test_phases_file_tiles_each_step_of_each_rank_as_the_metrics_say(run_dir):
    phases = analysis.load_phases(run_dir)
    assert list(phases.columns) == list(frames.PHASE_COLUMNS)
    assert set(phases["rank"]) == {0, 1} and set(phases["train/global_step"]) == set(STEPS)
    assert set(phases["phase"]) <= set(PHASES) and {"generate", "train"} <= set(phases["phase"])
    metrics = analysis.load_run(run_dir).set_index("train/global_step")
    for _, own in phases.groupby(["train/global_step", "rank"]):
        assert (own["end"] > own["start"]).all()
        np.testing.assert_allclose(own["start"].iloc[1:], own["end"].iloc[:-1])  # back to back, no gap
        assert (own["phase"].iloc[1:].to_numpy() != own["phase"].iloc[:-1].to_numpy()).all(), "pieces merged"
    # the metrics are means over ranks of these same intervals
    per_rank = phases.assign(d=phases["end"] - phases["start"])
    for phase in PHASES:
        mean = per_rank[per_rank["phase"] == phase].groupby(["train/global_step", "rank"])["d"].sum()
        mean = mean.unstack(fill_value=0.0).reindex(index=STEPS, columns=[0, 1], fill_value=0.0).mean(axis=1)
        np.testing.assert_allclose(mean, metrics[f"timing_s/{phase}"], rtol=1e-6, atol=1e-9)
    span = phases.groupby(["train/global_step", "rank"]).agg(start=("start", "min"), end=("end", "max"))
    np.testing.assert_allclose(
        (span["end"] - span["start"]).groupby(level=0).mean(), metrics["timing_s/step"], rtol=1e-6
    )


@pytest.mark.skipif(not no_gpu(), reason="a machine with a GPU may have NVML samples")
def test_without_nvml_the_samples_are_empty_and_the_timeline_draws_the_phases_with_a_note(run_dir):
    samples = analysis.load_gpu_samples(run_dir)
    assert samples.empty and list(samples.columns) == list(frames.SAMPLE_COLUMNS)
    fig = plots.gpu_timeline(samples, analysis.load_phases(run_dir))
    assert fig.get_suptitle().startswith(plots.NO_NVML)
    assert [ax.get_ylabel() for ax in fig.axes] == ["rank 0", "rank 1"]
    assert all(any(isinstance(c, PolyCollection) for c in ax.collections) for ax in fig.axes)


def samples_from_phases(phases, interval_s: float = 0.01):
    """The gpu_samples.jsonl rows an NVML sampler would have written for these (real) phases on a GPU machine: one
    GPU per rank and a vLLM server GPU sampled by rank 0, labelled by the telemetry's own label_samples; each
    phase gets its own utilisation so that the curve shows where the shading is."""
    util = {"generate": 90.0, "sync_weights": 40.0, "reward": 5.0, "train": 70.0, "other": 20.0}
    rows = []
    for rank, own in phases.groupby("rank"):
        records = own.to_dict("records")
        segments = [Segment(r["start"], r["end"], r["phase"]) for r in records]
        gpus = [str(rank), *(["server0"] if rank == 0 else [])]
        times = np.arange(own["start"].min(), own["end"].max(), interval_s)
        raw = [Sample(float(t), gpu, 0.0, 10.0 + rank, 300.0, 1980.0) for t in times for gpu in gpus]
        for sample, phase in aggregate.label_samples(raw, segments):
            step = next(r["train/global_step"] for r in records if r["start"] <= sample.t <= r["end"])
            rows.append(
                {"train/global_step": step, "rank": rank, "phase": phase, **{**sample.__dict__, "util": util[phase]}}
            )
    return pd.DataFrame(rows, columns=list(frames.SAMPLE_COLUMNS))


def test_phases_from_samples_end_where_the_samples_pause():
    """Samples every 10 ms: a step's generate and train, 0.3 s in no phase (between steps), the next step's generate.
    The train phase ends a sampling interval past its last sample, not where the next step starts."""
    taken = [(1, "generate", 0.0), (1, "train", 0.05), (2, "generate", 0.40)]
    samples = pd.DataFrame(
        [
            {run_files.STEP_KEY: step, "rank": 0, "phase": phase, "t": start + i * 0.01}
            for step, phase, start in taken
            for i in range(5)
        ]
    )
    derived = frames.phases_from_samples(samples)
    assert derived["phase"].tolist() == ["generate", "train", "generate"]
    np.testing.assert_allclose(derived[["start", "end"]].to_numpy(), [[0.0, 0.05], [0.05, 0.10], [0.40, 0.45]])


def test_timeline_draws_each_gpu_over_the_phases_of_the_rank_that_sampled_it(run_dir, tmp_path):
    phases = analysis.load_phases(run_dir)
    samples = samples_from_phases(phases)
    fig = plots.gpu_timeline(samples, phases)
    panels = [ax for ax in fig.axes if ax.get_ylabel().startswith("GPU ")]
    assert [ax.get_ylabel() for ax in panels] == ["GPU 0\nutil %", "GPU 1\nutil %", "GPU server0\nutil %"]
    origin = min(samples["t"].min(), phases["start"].min())
    for ax, gpu, rank in zip(panels, ["0", "1", "server0"], [0, 1, 0], strict=True):
        line = ax.get_lines()[0]
        own = samples[samples["gpu"] == gpu]
        np.testing.assert_allclose(line.get_xdata(), own["t"] - origin)
        np.testing.assert_allclose(line.get_ydata(), own["util"])
        # the shading: per phase, the intervals of the sampling rank, to the second
        shaded = [c for c in ax.collections if isinstance(c, PolyCollection)]
        rank_phases = phases[phases["rank"] == rank]
        assert len(shaded) == rank_phases["phase"].nunique()
        widths = sorted(sum(np.ptp(p.vertices[:, 0]) for p in c.get_paths()) for c in shaded)
        expected = sorted((rank_phases["end"] - rank_phases["start"]).groupby(rank_phases["phase"]).sum())
        np.testing.assert_allclose(widths, expected, rtol=1e-6)
    # where phases.jsonl is missing (older runs), the same intervals come back from the samples' labels
    derived = frames.phases_from_samples(samples)
    for (rank, phase), real in phases.assign(d=phases["end"] - phases["start"]).groupby(["rank", "phase"])["d"]:
        got = derived[(derived["rank"] == rank) & (derived["phase"] == phase)]
        pieces = ((phases["rank"] == rank) & (phases["phase"] == phase)).sum()
        assert abs((got["end"] - got["start"]).sum() - real.sum()) <= 2 * 0.01 * pieces + 1e-9
    fig.savefig(tmp_path / "timeline.png")
    assert imread(tmp_path / "timeline.png").shape[0] > 300
    # zoomed on one step: only its samples, phases and step line
    zoom = plots.gpu_timeline(samples, phases, steps=(2, 2))
    step2 = samples[(samples["gpu"] == "0") & (samples["train/global_step"] == 2)]
    np.testing.assert_allclose(zoom.axes[0].get_lines()[0].get_ydata(), step2["util"])
    assert [t.get_text() for t in zoom.axes[0].texts] == ["2"]


def test_training_curves_plot_the_logged_rewards_and_lengths_against_the_global_step(run_dir):
    metrics = analysis.load_run(run_dir)
    reward_ax, length_ax = plots.training_curves(metrics).axes
    lines = {line.get_label(): line for line in reward_ax.get_lines()}
    assert {"reward", "exact_answer", "boxed_format", "length"} <= set(lines)
    np.testing.assert_allclose(lines["reward"].get_xdata(), STEPS)
    np.testing.assert_allclose(lines["reward"].get_ydata(), metrics["reward"])
    np.testing.assert_allclose(length_ax.get_lines()[0].get_ydata(), metrics["completions/mean_length"])
    assert length_ax.get_xlabel() == "train/global_step"


# ----------------------------------------------------------------------------------------------- sweep frames


def test_sweep_frame_has_each_jobs_placement_and_numbers(sweep_dir):
    jobs = analysis.load_sweep(sweep_dir)
    assert list(jobs.columns) == list(tables.COLUMNS)
    assert list(jobs["status"]) == ["finished"] * 4 + ["interrupted", "cancelled"]
    started = jobs.iloc[:5]  # the cancelled job never wrote a config: its placement is unknown
    assert list(started["placement"]) == ["colocate"] * 5 and jobs["placement"].isna().iloc[5]
    assert list(started["vllm_tensor_parallel_size"]) == [1, 1, 1, 2, 2]
    assert list(started["vllm_gpu_memory_utilization"]) == [0.3, 0.5, 0.7, 0.3, 0.5]
    assert list(started["world_size"]) == [2] * 5 and list(started["gpus"]) == [2] * 5
    done = jobs[jobs["status"] == "finished"]
    assert (done["timing_s/step"] > 0).all() and (done["perf/tokens_per_s_per_gpu"] > 0).all()
    phases = done[[f"timing_s/{p}" for p in PHASES]].sum(axis=1)
    np.testing.assert_allclose(phases, done["timing_s/step"], rtol=1e-6)
    np.testing.assert_allclose(done["perf/tokens_per_s_per_train_gpu"], done["perf/tokens_per_s_per_gpu"])
    # NVML's peak: the memory vLLM is given shows in it
    peaks = done.set_index(["vllm_tensor_parallel_size", "vllm_gpu_memory_utilization"])["memory/peak_gb"]
    assert peaks[1, 0.3] < peaks[1, 0.5] < peaks[1, 0.7] < 141
    stopped = jobs.iloc[4:]
    assert stopped["timing_s/step"].isna().all() and "got signal: 2" in stopped["note"].iloc[0]
    assert {"placement", "vllm_tensor_parallel_size", "timing_s/other"} <= set(
        pd.read_csv(sweep_dir / run_files.SWEEP_SUMMARY).columns
    )


def test_heatmap_shows_the_sparse_grid_with_why_cells_are_empty(sweep_dir):
    jobs = analysis.load_sweep(sweep_dir)
    fig = plots.throughput_heatmap(jobs)
    ax = fig.axes[0]
    grid = ax.get_images()[0].get_array()
    assert grid.shape == (2, 3)  # TP 1, 2 × memory 0.3, 0.5, 0.7
    done = jobs[jobs["status"] == "finished"]
    tp1 = done[done["vllm_tensor_parallel_size"] == 1].sort_values("vllm_gpu_memory_utilization")
    np.testing.assert_allclose(grid[0], tp1["perf/tokens_per_s_per_gpu"])
    assert grid[1, 0] == done.loc[done["vllm_tensor_parallel_size"] == 2, "perf/tokens_per_s_per_gpu"].item()
    assert np.ma.getmaskarray(grid[1])[1:].all()
    texts = [t.get_text() for t in ax.texts]
    assert texts[4:] == ["interrupted", ""], "the interrupted cell says so; the cancelled job has no cell"
    # the best cell is framed: the most tokens/s, the shortest step (both TP 1 at 0.7 here)
    for metric, best in (("perf/tokens_per_s_per_gpu", max), ("timing_s/step", min)):
        (frame,) = plots.throughput_heatmap(jobs, metric=metric).axes[0].patches
        j = list(tp1[metric]).index(best(tp1[metric]))
        assert frame.get_xy() == (j - 0.5, -0.5)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["1", "2"]
    # a hole in the grid (a cell without any job) stays blank; a grid with no colocated job is a note
    holed = plots.throughput_heatmap(jobs.drop(index=jobs.index[4]))
    assert [t.get_text() for t in holed.axes[0].texts].count("") == 2
    empty = plots.throughput_heatmap(jobs.assign(placement="none"))
    assert "no colocated vLLM jobs" in empty.axes[0].texts[0].get_text()


def test_colocate_vs_server_notes_a_sweep_without_server_jobs_and_compares_per_gpu_used(sweep_dir):
    jobs = analysis.load_sweep(sweep_dir)
    fig = plots.colocate_vs_server(jobs)
    note = fig.axes[1].texts[0].get_text()
    assert note.startswith("no server jobs in this sweep") and "Per GPU used" in note
    # beside a server job that made 1.2× the best colocated job's tokens/s (on 2 GPUs) with 2 trainer + 1 server
    # GPUs: colocation wins per GPU used (1 / (1.2 × 2/3)) and loses per training GPU (1 / 1.2)
    best = jobs.loc[jobs["perf/tokens_per_s_per_gpu"].idxmax()]
    server = best.copy()
    server[["placement", "world_size", "gpus", "perf/tokens_per_s"]] = ["server", 2, 3, 1.2 * best["perf/tokens_per_s"]]
    server["perf/tokens_per_s_per_gpu"] = server["perf/tokens_per_s"] / 3
    server["perf/tokens_per_s_per_train_gpu"] = server["perf/tokens_per_s"] / 2
    both = pd.concat([jobs, server.to_frame().T], ignore_index=True).infer_objects()
    title = plots.colocate_vs_server(both).axes[0].get_title()
    assert title == "colocate vs server: 1.25× per GPU used, 0.83× per training GPU"


def test_peak_memory_draws_one_line_per_tp_and_is_a_note_without_nvml(sweep_dir):
    jobs = analysis.load_sweep(sweep_dir)
    ax = plots.peak_memory(jobs).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert sorted(lines) == ["colocate, TP 1", "colocate, TP 2"]
    np.testing.assert_allclose(lines["colocate, TP 1"].get_xdata(), [0.3, 0.5, 0.7])
    done = jobs[(jobs["status"] == "finished") & (jobs["vllm_tensor_parallel_size"] == 1)]
    np.testing.assert_allclose(lines["colocate, TP 1"].get_ydata(), done["memory/peak_gb"])
    unmeasured = plots.peak_memory(jobs.assign(**{"memory/peak_gb": np.nan}))  # a sweep on CPU: no NVML
    assert unmeasured.axes[0].texts[0].get_text().startswith(plots.NO_NVML)


# ----------------------------------------------------------------------------------- notebooks and the command


def assert_pngs(paths, names) -> None:
    assert sorted(Path(p).stem for p in paths) == sorted(names)
    for path in paths:
        height, width, _ = imread(path).shape
        assert height > 200 and width > 300, path


def figure_outputs(nb) -> int:
    """Code cells whose output is a PNG image."""
    return sum(any("image/png" in o.get("data", {}) for o in c.get("outputs", [])) for c in nb.cells)


def test_sweep_notebook_executes_headless_with_its_parameters(sweep_dir, tmp_path):
    figures = tmp_path / "figures"
    nb = notebook.execute(
        NOTEBOOKS / "sweep.ipynb",
        {"sweep_dir": str(sweep_dir), "figures_dir": str(figures)},
        tmp_path / "sweep.executed.ipynb",
        cwd=tmp_path,
    )
    assert "injected-parameters" in nb.cells[2].metadata["tags"]
    assert figure_outputs(nb) == 4
    assert_pngs(figures.glob("*.png"), plots.sweep_figures(analysis.load_sweep(sweep_dir)))
    assert figure_outputs(nbformat.read(tmp_path / "sweep.executed.ipynb", 4)) == 4


def test_run_notebook_executes_headless_from_the_script(run_dir, tmp_path):
    figures = tmp_path / "figures"
    out = tmp_path / "run.executed.ipynb"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "colocated_grpo.analysis.notebook",
            str(NOTEBOOKS / "run.py"),
            f"run_dir={run_dir}",
            "timeline_steps=(2, 3)",
            f"figures_dir={figures}",
            "-o",
            str(out),
        ],
        cwd=tmp_path,
        check=True,
        timeout=300,
    )
    nb = nbformat.read(out, 4)
    assert "timeline_steps = (2, 3)\n" in nb.cells[2].source
    assert figure_outputs(nb) == 3
    assert_pngs(figures.glob("*.png"), ["gpu_timeline", "training_curves", "step_phases"])
    table = next(o for c in nb.cells for o in c.get("outputs", []) if "text/html" in o.get("data", {}))
    assert "steady state" in table["data"]["text/plain"] and "colocate" in table["data"]["text/plain"]


def test_render_writes_the_sweeps_and_a_runs_pngs_next_to_them(sweep_dir, run_dir):
    for directory, names in (
        (sweep_dir, ["throughput_heatmap", "step_breakdown", "peak_memory", "colocate_vs_server"]),
        (run_dir, ["gpu_timeline", "training_curves", "step_phases"]),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "colocated_grpo.analysis", "render", str(directory)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        paths = proc.stdout.split()
        assert all(Path(p).parent == directory / "figures" for p in paths)
        assert_pngs(paths, names)
    proc = subprocess.run(
        [sys.executable, "-m", "colocated_grpo.analysis", "render", str(run_dir / "figures")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "neither a run directory" in proc.stderr


def test_notebooks_are_paired_with_their_scripts_and_stripped():
    scripts = sorted(NOTEBOOKS.glob("*.py"))
    assert [p.stem for p in scripts] == ["run", "sweep"]
    for script in scripts:
        pair = script.with_suffix(".ipynb")
        text, stored = jupytext.read(script), nbformat.read(pair, 4)
        assert [(c.cell_type, c.source, c.metadata.get("tags")) for c in text.cells] == [
            (c.cell_type, c.source, c.metadata.get("tags")) for c in stored.cells
        ], f"{pair.name} and {script.name} differ: jupytext --sync {script}"
        assert stored.metadata["jupytext"]["formats"] == "ipynb,py:percent"
        for cell in stored.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{pair.name}: outputs not stripped"
        parameters = [c for c in stored.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(parameters) == 1 and "figures_dir = None" in parameters[0].source


# --------------------------------------------------------------------------------------------- the W&B API


TELEMETRY = ("timing_s/", "perf/", "gpu/", "memory/", "placement/", "telemetry/")


class WandbRunFromFiles:
    """What wandb.Api hands out for a run, filled from a real run directory as the run logged it: TRL's metrics
    under `train/` in one history row per step, the telemetry's in another; config {"cfg": …, placement, world
    size}; the steady-state summary."""

    def __init__(self, run_dir: Path, group: str):
        run = read_json(run_dir / "run.json")
        self.name, self.state, self.group = run_dir.name, run["status"], group
        self.path = ["entity", "project", run_dir.name]
        self.config = {
            "cfg": yaml.safe_load((run_dir / "config.yaml").read_text()),
            "placement": run["placement"],
            "world_size": run["world_size"],
        }
        self.summary_metrics = {**read_json(run_dir / "summary.json"), "_runtime": 1.0}
        self.history = []
        for step, m in enumerate(read_jsonl(run_dir / "metrics.jsonl")):
            trl = {f"train/{k}": v for k, v in m.items() if not k.startswith(TELEMETRY) and k != "train/global_step"}
            ours = {k: v for k, v in m.items() if k.startswith(TELEMETRY)}
            self.history += [
                {**trl, "train/global_step": m["train/global_step"], "_step": 2 * step},
                {**ours, "train/global_step": m["train/global_step"], "_step": 2 * step + 1},
            ]

    def scan_history(self):
        return iter(self.history)


class FakeApi:
    def __init__(self, runs):
        self._runs = runs

    def run(self, path):
        return next(r for r in self._runs if "/".join(r.path) == path)

    def runs(self, path, filters=None):
        assert path == "entity/project"
        return [r for r in self._runs if not filters or r.group == filters["group"]]


def test_wandb_loaders_give_the_frames_of_the_run_files(run_dir, sweep_dir):
    finished = [p.parent for p in sorted(sweep_dir.glob("*/metrics.jsonl"))]
    api = FakeApi([WandbRunFromFiles(run_dir, "other"), *(WandbRunFromFiles(d, sweep_dir.name) for d in finished)])
    from_api = analysis.load_wandb_run(f"entity/project/{run_dir.name}", api=api)
    pd.testing.assert_frame_equal(from_api, analysis.load_run(run_dir), check_like=True)
    sweep = analysis.load_wandb_sweep("entity/project", sweep_dir.name, api=api)
    files = analysis.load_sweep(sweep_dir)
    files = files[files["status"] == "finished"].reset_index(drop=True)
    keys = [*tables.PLACEMENT_KEYS, *tables.SUMMARY_KEYS]
    pd.testing.assert_frame_equal(sweep[keys], files[keys], check_dtype=False)
    assert list(sweep["overrides"]) == [d.name for d in finished] and set(sweep["status"]) == {"finished"}
    assert all(not math.isnan(r) for r in sweep["reward"])
