"""A study's definition (a YAML file in sweeps/studies/), the commands of its steps, where its results lie, and the
environment it ran in."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

import yaml

from colocated_grpo.analysis import tables
from colocated_grpo.provenance import REPO, git_state, package_versions
from colocated_grpo.run_files import read_json


def load(path: str | Path) -> dict:
    """A study definition, checked: models, cases (name: overrides), baseline (a case, or a mapping from cases to
    the case each is compared with), optional common and bench."""
    study = yaml.safe_load(Path(path).read_text())
    problems = []
    if not isinstance(study, dict):
        raise SystemExit(f"{path}: a study is a mapping with models, cases and baseline")
    if not study.get("models"):
        problems.append("models: list at least one conf/model option")
    if not isinstance(study.get("cases"), dict) or not study["cases"]:
        problems.append("cases: map each case name to its list of overrides")
    else:
        named = study.get("baseline")
        named = [*named.keys(), *named.values()] if isinstance(named, dict) else [named]
        if unknown := [b for b in named if b not in study["cases"]]:
            problems.append(f"baseline: {unknown} must be cases of {list(study['cases'])}")
    for name, value in {**(study.get("cases") or {}), **(study.get("bench") or {})}.items():
        if not isinstance(value, list):
            problems.append(f"{name}: give a list of arguments, not {value!r}")
    if problems:
        raise SystemExit(f"{path}: invalid study:\n" + "\n".join(f"  - {p}" for p in problems))
    study.setdefault("common", [])
    study.setdefault("bench", {})
    return study


def baselines(study: dict) -> dict[str, str]:
    """case → the case its speed-up is measured against (one baseline for all, or the study's pairs)."""
    baseline = study["baseline"]
    return dict(baseline) if isinstance(baseline, dict) else dict.fromkeys(study["cases"], baseline)


def case_command(study: dict, model: str, case: str, case_dir: Path, repo: Path = REPO) -> list[str]:
    """The one-job multirun that runs `case` for `model`: `python train.py -m …` (the checkout `repo`'s) through
    the torchrun launcher."""
    overrides = [f"model={model}", *study["common"], *study["cases"][case], f"hydra.sweep.dir={case_dir}"]
    return [sys.executable, str(repo / "train.py"), "-m", *overrides]


def bench_command(model: str, args: list[str], out: Path) -> list[str]:
    """The standalone generation benchmark `args` for `model`, its results written to `out`."""
    module = "colocated_grpo.bench.vllm_generate"
    return [sys.executable, "-m", module, "--model", model, *map(str, args), "--json", str(out)]


def case_job(case_dir: Path) -> dict | None:
    """The row (analysis.tables.COLUMNS) of a case's one job; None when it never ran."""
    return next(iter(tables.load_jobs(case_dir)), None)


def case_status(case_dir: Path) -> str | None:
    """The status of a case's job (finished, failed, skipped, …); None when it never ran."""
    job = case_job(case_dir)
    return job["status"] if job else None


def describe(case_dir: Path) -> str:
    job = case_job(case_dir)
    if job is None:
        return "no job ran (see sweep.log)"
    if job["status"] != "finished" or job.get("timing_s/step") is None:
        return f"{job['status']}: {job.get('note') or ''}".strip()
    return f"finished: {job['timing_s/step']:.3f} s/step, {job['perf/tokens_per_s_per_gpu']:,.0f} tokens/s/GPU"


def environments(out: Path) -> list[dict]:
    """The environment of each `run` into this study directory, oldest first."""
    found = read_json(out / "env.json") or []
    return [found] if isinstance(found, dict) else found


def environment() -> dict:
    """Where the study ran: date, host, GPUs and driver (NVML when present), package versions."""
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "git": git_state(),
        "versions": package_versions(),
        "gpus": [],
        "driver": None,
    }
    try:
        import pynvml

        pynvml.nvmlInit()
        env["driver"] = pynvml.nvmlSystemGetDriverVersion()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory_gib = pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30
            env["gpus"].append(f"{pynvml.nvmlDeviceGetName(handle)} ({memory_gib:.0f} GiB)")
        pynvml.nvmlShutdown()
    except Exception:  # no NVIDIA driver here: a CPU study
        env["gpus"] = [f"none (CPU: {os.cpu_count()} cores)"]
    return env
