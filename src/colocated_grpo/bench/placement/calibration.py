"""The calibration file: what one GPU measured, in the units the model uses (docs/placement.md).

Built by `calibrate` from the one-GPU runs and generation benchmarks of study directories; multi-GPU jobs are left
out (`validate` checks the model against them). A run's outputs and its sync each feed their own curve or cost.

    {"format": 1, "gpu": {...}, "sources": [...], "notes": [...],
     "models": {"qwen2.5-1.5b": {
        "params_b": 1.544, "kv_bytes_per_token": 28672, "prompt_tokens": 61, "completion_tokens": 256, "mem": 0.3,
        "kv_cache_tokens": 1425000,
        "generate": {"trl": [[32, 5514.0], …], "fast": [[32, 10160.0], …]},  # completions per engine, tokens/s
        "server_engine": {"factor": 1.27} or {"curve": [[32, …], …]},
        "sync_s": {"trl": 0.27, "fast": 0.024}, "sleep_wake_s": 0.092,
        "train": {"fixed_s": 0.007, "s_per_token": 2.9e-05}, "other": {…}, "reward_s_per_completion": 5e-05,
        "train_gb": 21.3}}}
"""

from __future__ import annotations

import csv
import fnmatch
import statistics
from collections import defaultdict
from pathlib import Path

from colocated_grpo.bench.placement import measured
from colocated_grpo.bench.placement.shapes import shape_for
from colocated_grpo.provenance import REPO
from colocated_grpo.run_files import read_json

FORMAT = 1

# What the calibrating GPU is, for the terms no one-GPU run measures (docs/placement.md: the model).
H200 = {
    "name": "NVIDIA H200 (140 GiB)",
    "memory_gb": 150.0,  # NVML's total in GB (140 GiB)
    "hbm_gb_s": 4800.0,  # HBM3e, datasheet
    "peak_tflops": 989.0,  # dense bf16, datasheet
    "prefill_efficiency": 0.4,  # assumed share of peak a prefill reaches
    "allreduce_gb_s": 360.0,  # assumed NCCL all-reduce bus bandwidth over NVLink 4 (not measurable on one GPU)
}


def build(directories: list[str | Path], only: list[str] | None = None) -> dict:
    """A calibration from the one-GPU jobs and benchmarks under `directories` (study or sweep directories); with
    `only`, from those whose MODEL/CASE (or MODEL/BENCH, MODEL without -random) matches one of its shell patterns:
    the rest of a study is then held out, for `validate` to predict."""
    jobs = [job for d in directories for job in measured.load(d)]
    chosen = [j for j in jobs if _chosen(f"{j.model}/{j.case}", only)]
    used = [j for j in chosen if j.gpus == 1 and j.placement in ("colocate", "colocate_sleep")]
    calibration = {
        "format": FORMAT,
        "gpu": dict(H200),
        "sources": sorted({source(j) for j in used}),
        "left_out": sorted(f"{j.model} {j.case} ({j.gpus} GPUs)" for j in jobs if j not in used),
        "only": only or [],
        "notes": [],
        "models": {},
    }
    benches = _benches(directories, only)
    for model in sorted({j.model for j in used}):
        mine = [j for j in used if j.model == model]
        calibration["models"][model] = _model(mine, benches.get(model, []), calibration["notes"])
    _fill_request_curves(calibration["models"], calibration["notes"])
    _train_memory(directories, calibration, only)
    return calibration


def _model(jobs: list[measured.Job], benches: list[dict], notes: list[str]) -> dict:
    first = jobs[0]
    kv_tokens = [j.kv_cache_tokens for j in jobs if j.kv_cache_tokens]
    entry = {
        "params_b": first.params_b,
        "kv_bytes_per_token": shape_for(first.params_b).kv_bytes_per_token,
        "prompt_tokens": statistics.mean(j.prompt_tokens for j in jobs),
        "completion_tokens": statistics.mean(j.completion_tokens for j in jobs),
        "mem": statistics.mode(j.mem for j in jobs),
        "kv_cache_tokens": statistics.mean(kv_tokens) if kv_tokens else None,
        "generate": {},
        "sync_s": {},
    }
    # Generation: the generate phase of each colocate run (sleep mode's own cost is below), as completion tokens/s
    # of its one engine at its batch.
    awake = [j for j in jobs if j.placement == "colocate" and (j.one_forward or not j.fast_outputs)] or jobs
    for name, fast in (("trl", False), ("fast", True)):
        by_batch = defaultdict(list)
        for j in awake:
            if j.fast_outputs == fast and j.phases["generate"] and j.mem == entry["mem"]:  # one memory share
                by_batch[j.completions].append(j.completions * j.completion_tokens / j.phases["generate"])
        if by_batch:
            entry["generate"][name] = [[b, statistics.mean(r)] for b, r in sorted(by_batch.items())]
        if sync := [j.phases["sync_weights"] for j in jobs if j.fast_sync == fast and j.phases["sync_weights"]]:
            entry["sync_s"][name] = statistics.mean(sync)
    entry["sleep_wake_s"] = _sleep_cost(jobs)
    ours = [j for j in jobs if j.fast_outputs and j.one_forward] or jobs
    for phase in ("train", "other"):  # against the tokens each training GPU handles, on our path
        entry[phase] = _line([(_tokens_per_gpu(j), j.phases[phase]) for j in ours])
    # What TRL's own path (its request, its extra no-grad forward) and that forward alone add to train and other
    entry["added_s_per_token"] = {
        "trl_path": _added(entry, [j for j in jobs if not j.fast_outputs and not j.one_forward]),
        "extra_forward": _added(entry, [j for j in jobs if j.fast_outputs and not j.one_forward]),
    }
    entry["reward_s_per_completion"] = statistics.mean(j.phases["reward"] / j.completions for j in jobs)
    entry["server_engine"] = _server_engine(entry, benches, first.model, notes)
    return entry


def _request_cost(entry: dict) -> float | None:
    """Seconds TRL's request adds per sequence and decoding step to ours (its log-prob objects and text are built
    per token on the host, whatever the model), where both were measured at the same batch."""
    fast, trl = dict(entry["generate"].get("fast", [])), dict(entry["generate"].get("trl", []))
    if both := [b for b in trl if b in fast]:
        return statistics.mean((b / trl[b] - b / fast[b]) / b for b in both)
    return None


def _fill_request_curves(models: dict, notes: list[str]) -> None:
    """TRL's request at each batch our request was measured at and it was not: our decoding step plus its cost per
    sequence and step, measured on the same model or else on another."""
    measured = {name: cost for name, entry in models.items() if (cost := _request_cost(entry)) is not None}
    for name, entry in models.items():
        fast, trl = dict(entry["generate"].get("fast", [])), dict(entry["generate"].get("trl", []))
        donor = name if name in measured else next(iter(measured), None)
        if donor is None or set(fast) <= set(trl):
            continue
        cost = measured[donor]
        entry["generate"]["trl"] = [[b, trl.get(b) or b / (b / r + cost * b)] for b, r in sorted(fast.items())]
        notes.append(
            f"{name}: TRL's request at batches {sorted(set(fast) - set(trl))} = ours + {cost * 1e6:.1f} µs per "
            f"sequence and decoding step (measured on {donor})"
        )


def _sleep_cost(jobs: list[measured.Job]) -> float | None:
    """Seconds sleep mode adds to a step: its sleep/wake phase, plus what its generate phase takes beyond a colocate
    run's at the same batch, request and share (a woken engine generates slower; measured, not split further)."""
    found = []
    for sleep in (j for j in jobs if j.placement == "colocate_sleep"):
        same = (sleep.completions, sleep.fast_outputs, sleep.one_forward, sleep.mem)
        awake = [
            j.phases["generate"]
            for j in jobs
            if j.placement == "colocate" and (j.completions, j.fast_outputs, j.one_forward, j.mem) == same
        ]
        slower = sleep.phases["generate"] - statistics.mean(awake) if awake else 0.0
        found.append(sleep.phases["sleep_wake"] + max(slower, 0.0))
    return statistics.mean(found) if found else None


def _tokens_per_gpu(job: measured.Job) -> float:
    """Prompt and completion tokens each training GPU handles per step."""
    return job.completions / job.train_gpus * (job.prompt_tokens + job.completion_tokens)


def _added(entry: dict, jobs: list[measured.Job]) -> dict[str, float]:
    """Seconds per token (of a training GPU) `jobs` spent in train and in other beyond our path's fitted line, where
    that is more than nothing; empty when no such job was measured."""
    found = {}
    for phase in ("train", "other"):
        line = entry[phase]
        extra = [(j.phases[phase] - line["fixed_s"]) / _tokens_per_gpu(j) - line["s_per_token"] for j in jobs]
        if extra and statistics.mean(extra) > 0:
            found[phase] = statistics.mean(extra)
    return found


def _server_engine(entry: dict, benches: list[dict], model: str, notes: list[str]) -> dict | None:
    """A `trl vllm-serve` engine's rate: measured directly (a default-engine bench with TRL's request over batch
    sizes), else the in-run TRL-request curve × (default engine / in-run engine) at a batch both measured."""
    direct = [
        [r["prompts"], statistics.mean(r["tokens_per_s"])]
        for b in benches
        if b["settings"].get("engine", "default") == "default"
        for r in b.get("results", [])
        if r.get("outputs") == "trl"
    ]
    if direct:
        return {"curve": sorted(direct)}
    fast = dict(entry["generate"].get("fast", []))
    for b in benches:
        s = b["settings"]
        if s.get("engine", "default") == "default" and s.get("prompts") in fast and not b.get("results"):
            factor = statistics.mean(b["tokens_per_s"]) / fast[s["prompts"]]
            notes.append(
                f"{model}: server engine = in-run TRL-request rate × {factor:.2f} (vLLM's default engine alone, "
                f"no log-probs, / this model's in-run fast-outputs rate, both at {s['prompts']} completions)"
            )
            return {"factor": factor}
    notes.append(f"{model}: no default-engine benchmark; server engine = the in-run TRL-request curve")
    return {"factor": 1.0}


def source(job: measured.Job) -> str:
    """Where a job's runs lie (runs/<model>/<case> of a study, or the sweep), relative to the checkout when inside
    it: a job is in-sample when this is among a calibration's sources."""
    path = Path(job.source).resolve().parent
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _benches(directories, only: list[str] | None) -> dict[str, list[dict]]:
    found = defaultdict(list)
    for d in directories:
        for path in sorted(Path(d).glob("bench/*/*.json")):
            if (bench := read_json(path)) and "settings" in bench:
                model = _build_name(bench["settings"]["model"])
                if _chosen(f"{model}/{path.stem}", only):
                    found[model].append(bench)
    return found


def _chosen(name: str, only: list[str] | None) -> bool:
    return not only or any(fnmatch.fnmatchcase(name, pattern) for pattern in only)


def _build_name(option: str) -> str:
    """conf/model option → the build it makes (qwen2.5-1.5b-random → qwen2.5-1.5b), the name jobs carry."""
    return option.removesuffix("-random")


def _train_memory(directories, calibration: dict, only: list[str] | None) -> None:
    """The most a training GPU held (train_mem_gb) in the one-GPU colocate_sleep cases of results.csv."""
    for d in directories:
        path = Path(d) / "results.csv"
        if not path.exists():
            continue
        for row in csv.DictReader(path.open()):
            model = calibration["models"].get(_build_name(row["model"]))
            chosen = _chosen(f"{_build_name(row['model'])}/{row['case']}", only)
            if model is not None and chosen and row["placement"] == "colocate_sleep" and row["gpus"] == "1":
                model["train_gb"] = max(model.get("train_gb") or 0.0, float(row["train_mem_gb"]))


def _line(points: list[tuple[float, float]]) -> dict:
    """Least squares y = fixed + slope · x (fixed ≥ 0)."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if len(set(xs)) < 2:
        return {"fixed_s": 0.0, "s_per_token": statistics.mean(y / x for x, y in points)}
    slope, fixed = statistics.linear_regression(xs, ys)
    if fixed < 0:
        return {"fixed_s": 0.0, "s_per_token": sum(ys) / sum(xs)}
    return {"fixed_s": fixed, "s_per_token": slope}


def load(path: str | Path) -> dict:
    if not Path(path).exists():
        raise SystemExit(
            f"{path}: no such file. Measure your GPU into it with `python -m colocated_grpo.bench.placement measure "
            f"sweeps/studies/calibration_h200.yaml --dir DIR --out {path}`, or use the committed H200 calibration, "
            "sweeps/results/placement_model/calibration_h200.json"
        )
    calibration = read_json(Path(path))
    if not isinstance(calibration, dict) or calibration.get("format") != FORMAT or not calibration.get("models"):
        raise SystemExit(f"{path}: not a calibration file (format {FORMAT}): make one with `placement calibrate`")
    return calibration
