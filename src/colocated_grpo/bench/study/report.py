"""A study's report: results.csv (one row per model and case: the mean over its repeats with their spread, speed-ups
against the baseline case, repeat k paired with repeat k), speedups.csv (each case against each of its baselines: the
median of the pairs with their spread, and the ratio of the means, on step time and on tokens/s), results.md (the
environment, the conditions, the tables, each run with its completions' lengths and the host's load during it, the
standalone generation rates and the exact commands; what ran on code that is not a commit's is marked on every line
it reaches) and study.png."""

from __future__ import annotations

import shlex
from pathlib import Path
from statistics import fmean, median

from colocated_grpo import run_files
from colocated_grpo.analysis import tables
from colocated_grpo.bench.study import learning
from colocated_grpo.bench.study.definition import (
    FLAG,
    TRIAL,
    baselines,
    bench_command,
    case_command,
    cases_of,
    environment_lines,
    environments,
    load,
    repeat_dirs,
    step_key,
    tree_note,
)
from colocated_grpo.provenance import REPO
from colocated_grpo.run_files import STEP_KEY, read_json, read_jsonl
from colocated_grpo.telemetry.aggregate import SteadyState
from colocated_grpo.telemetry.phases import PHASES

# Columns of results.csv, in order: the case, its kind and where it ran, step times, throughput, GPU use and memory.
# step_s and the other numbers: the mean over the case's finished repeats of each repeat's steady-state mean;
# step_s_min/max: its fastest and slowest step; *_spread_min/max: the lowest and highest repeat mean.
COLUMNS = (
    *("model", "case", "kind", "status", "repeats"),
    *("placement", "train_gpus", "gpus", "tp", "gpu_memory_utilization", "params_b"),
    *("step_s", "step_s_min", "step_s_max", "step_s_spread_min", "step_s_spread_max", "step_s_repeats"),
    *(f"{phase}_s" for phase in PHASES),
    *("tokens_per_step", "tokens_per_s"),
    *("tokens_per_s_per_gpu", "tokens_per_s_per_gpu_spread_min", "tokens_per_s_per_gpu_spread_max"),
    *("tokens_per_s_per_train_gpu", "gen_tokens_per_s_per_engine"),
    *("speedup_vs_baseline", "speedup_min", "speedup_max", "speedup_pairs"),
    *("util_generate", "util_sync_weights", "util_train", "train_mfu", "peak_gb", "train_mem_gb", "gen_mem_gb"),
    "sync_s_per_b_params",
    *("steps", "note"),
)
LENGTHS = ("mean_length", "p50_length", "p99_length", "clipped_ratio")
# A repeat's steady-state means: its row's key ← the metric (metrics.jsonl), averaged over the repeats.
MEANS = {
    "step_s": "timing_s/step",
    **{f"{phase}_s": f"timing_s/{phase}" for phase in PHASES},
    "tokens_per_step": "perf/tokens",
    "tokens_per_s": "perf/tokens_per_s",
    "tokens_per_s_per_gpu": "perf/tokens_per_s_per_gpu",
    "tokens_per_s_per_train_gpu": "perf/tokens_per_s_per_train_gpu",
    "gen_tokens_per_s": "perf/gen_tokens_per_s",
    "util_generate": "gpu/util_generate",
    "util_sync_weights": "gpu/util_sync_weights",
    "util_train": "gpu/util_train",
    "train_mfu": "perf/train_mfu",
    "peak_gb": "memory/peak_gb",
    # completion lengths in tokens (TRL's mean and share cut at the cap, our percentiles): what a step generated
    **{name: f"completions/{name}" for name in LENGTHS},
}
# speedups.csv: one row per model, case and baseline (a case may have several): tokens per step of each side, and the
# case's speed-up on step time and on tokens/s: the ratio of the means over the repeats both finished, the median of
# the pairs, the lowest and highest pair, and each pair's.
SPEEDUP_COLUMNS = (
    *("model", "case", "baseline", "tokens_per_step", "baseline_tokens_per_step"),
    *("step_speedup", "step_speedup_median", "step_speedup_min", "step_speedup_max", "step_speedup_pairs"),
    *("tokens_per_s_speedup", "tokens_per_s_speedup_median", "tokens_per_s_speedup_min", "tokens_per_s_speedup_max"),
    "tokens_per_s_speedup_pairs",
)


def rows(out: Path, study: dict) -> tuple[list[dict], list[dict]]:
    """One row per (model, case) of a study directory (COLUMNS), speed-ups against each case's first baseline; and
    one row per (model, case, baseline) with the speed-ups on step time and on tokens/s (SPEEDUP_COLUMNS)."""
    table, versus, _ = tables_of(out, study)
    return table, versus


def tables_of(out: Path, study: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """rows()' two tables, and one row per run of each case (run_row)."""
    against = baselines(study)
    table, versus, each = [], [], []
    runs_recorded = {key: (env, found) for env in environments(out) for key, found in (env.get("runs") or {}).items()}
    for model in study["models"]:
        repeats = {
            case: [repeat_row(d, study["warmup_steps"], k) for k, d in repeat_dirs(out / "runs" / model / case).items()]
            for case in cases_of(study, model)
        }
        made = {case: case_row(model, case, study["kinds"][case], runs) for case, runs in repeats.items()}
        for case, row in made.items():
            runs = repeats[case]
            pairs = {}
            for i, base in enumerate(b for b in against.get(case, []) if b in repeats):
                step = speedups(repeats[base], runs)
                if i == 0:
                    row.update(_columns(step, "speedup", mean="speedup_vs_baseline"))
                    pairs = _pairs(repeats[base], runs)
                if base != case and step:
                    versus.append(
                        {
                            **dict(model=model, case=case, baseline=base),
                            "tokens_per_step": row.get("tokens_per_step"),
                            "baseline_tokens_per_step": made[base].get("tokens_per_step"),
                            **_columns(step, "step_speedup"),
                            **_columns(speedups(repeats[base], runs, "tokens_per_s"), "tokens_per_s_speedup"),
                        }
                    )
            table.append({key: row.get(key) for key in COLUMNS})
            for r in runs:
                recorded = runs_recorded.get(step_key(model, case, r["repeat"]))
                each.append(run_row(model, case, r, pairs.get(r["repeat"]), *(recorded or ({}, {}))))
    return table, [{key: r.get(key) for key in SPEEDUP_COLUMNS} for r in versus], each


def run_row(model: str, case: str, repeat: dict, speedup: float | None, env: dict, recorded: dict) -> dict:
    """One run of a case (repeat_row) as results.md's Runs table shows it: its step time and tokens/s, its completions'
    lengths, its pair's speed-up on step time (`speedup`), the host's load during it and, where its code was not its
    commit's, why (`code`: a trial run, from the `env` of the `run` that made it; its own git record, from run.json)."""
    code = [note for note in (TRIAL if env.get("trial") else None, repeat.get("code")) if note]
    return {
        **dict(model=model, case=case, repeat=repeat["repeat"], status=repeat["status"]),
        **{key: repeat.get(key) for key in ("step_s", "tokens_per_s", *LENGTHS)},
        "speedup": speedup,
        "load_average": recorded.get("load_average"),
        "code": "; ".join(code) or None,
    }


def _columns(found: dict, name: str, mean: str | None = None) -> dict:
    """speedups()' result as columns: NAME (or `mean`), NAME_min, NAME_max, NAME_pairs."""
    return {(mean or name) if k == "mean" else f"{name}_{k}": v for k, v in found.items()}


def repeat_row(job_dir: Path, warmup: int, repeat: int) -> dict:
    """Repeat `repeat` of a case (a run directory with its job.json, as definition.repeat_dirs finds it): its job's
    status and placement, and its steady-state means (MEANS) computed here from metrics.jsonl over the steps past
    `warmup` (a plain TRL run and ours alike, whatever its summary.json left out), the fastest and slowest of those
    steps, and what training held of memory."""
    job = tables.job_row(job_dir, job_dir.parent) or {"status": "not run"}
    row = {"repeat": repeat, **job}
    if job["status"] != "finished":
        return row
    run = read_json(job_dir / run_files.RUN) or {}
    row["code"] = tree_note(run.get("git") or {})  # None: the code of the commit it names
    steady = SteadyState(warmup, [a.get("from_step", 0) for a in run.get("attempts", [])])
    kept = [m for m in read_jsonl(job_dir / run_files.METRICS) if steady.past_warmup(m.get(STEP_KEY, 0))]
    for m in kept:
        steady.add(m)
    means = steady.summary() if kept else {}
    if not kept:
        row["note"] = f"no step after the warm-up ({warmup} steps): no steady state to report"
    row.update({key: means.get(metric) for key, metric in MEANS.items()})
    if row["step_s"] is None:  # no telemetry: TRL's own step time
        row["step_s"] = means.get("step_time")
    times = [m["timing_s/step"] for m in kept if "timing_s/step" in m]
    row["step_s_min"], row["step_s_max"] = (min(times), max(times)) if times else (None, None)
    # The most memory held on a training GPU while it trained, and while it generated: what each side needs with the
    # other beside it (sleep mode hands vLLM's share to training, and back for generation).
    held = {"train": [], "generate": []}
    for s in read_jsonl(job_dir / run_files.GPU_SAMPLES):
        on_a_training_gpu = not str(s.get("gpu")).startswith("server")
        if s.get("phase") in held and steady.past_warmup(s.get(STEP_KEY, 0)) and on_a_training_gpu:
            held[s["phase"]].append(s["mem_gb"])
    row["train_mem_gb"], row["gen_mem_gb"] = (max(held[p]) if held[p] else None for p in ("train", "generate"))
    row["params"] = (read_json(job_dir / run_files.SUMMARY) or {}).get("model/params")
    return row


def case_row(model: str, case: str, kind: str, runs: list[dict]) -> dict:
    """A case's row from its repeats (repeat_row): the mean of the finished repeats' means, the spread of the repeat
    means, the fastest and slowest step of any; its status is the first repeat's that did not finish, if any."""
    row = {"model": model, "case": case, "kind": kind, "status": "not run"}
    if not runs:
        return row
    done = [r for r in runs if r["status"] == "finished" and r.get("step_s") is not None]
    row["status"] = next((r["status"] for r in runs if r["status"] != "finished"), "finished")
    notes = [(r["repeat"], r["note"]) for r in runs if r.get("note")]
    row["note"] = notes[0][1] if len(runs) == 1 and notes else "; ".join(f"rep{k}: {n}" for k, n in notes) or None
    first = done[0] if done else runs[0]
    row.update(
        placement=first.get("placement"),
        train_gpus=first.get("world_size"),
        gpus=first.get("gpus"),
        tp=first.get("vllm_tensor_parallel_size"),
        gpu_memory_utilization=first.get("vllm_gpu_memory_utilization"),
        steps=max((r["steps"] for r in runs if r.get("steps") is not None), default=None),
    )
    if not done:
        return row
    row["repeats"] = len(done)
    for key in MEANS:
        values = [r[key] for r in done if r.get(key) is not None]
        row[key] = fmean(values) if values else None
    for key in ("step_s", "tokens_per_s_per_gpu"):
        values = [r[key] for r in done if r.get(key) is not None]
        if values:
            row[f"{key}_spread_min"], row[f"{key}_spread_max"] = min(values), max(values)
    row["step_s_repeats"] = ", ".join(_num(r.get("step_s"), "{:.3f}") or "–" for r in runs)  # in repeat order
    fastest = [r["step_s_min"] for r in done if r.get("step_s_min") is not None]
    slowest = [r["step_s_max"] for r in done if r.get("step_s_max") is not None]
    row["step_s_min"], row["step_s_max"] = (min(fastest), max(slowest)) if fastest else (None, None)
    for key in ("train_mem_gb", "gen_mem_gb"):
        memory = [r[key] for r in done if r.get(key) is not None]
        row[key] = max(memory) if memory else None
    params = first.get("params")
    row["params_b"] = params / 1e9 if params else None
    if params and row["placement"] in ("colocate", "colocate_sleep", "server") and row["sync_weights_s"]:
        row["sync_s_per_b_params"] = row["sync_weights_s"] / (params / 1e9)
    gen = row.pop("gen_tokens_per_s")
    if gen and row["placement"] in ("colocate", "colocate_sleep"):
        row["gen_tokens_per_s_per_engine"] = gen / (row["train_gpus"] / (row["tp"] or 1))  # one engine per TP group
    elif gen and row["placement"] == "server":
        row["gen_tokens_per_s_per_engine"] = gen  # one engine on the server GPU(s)
    return row


def speedups(baseline: list[dict], runs: list[dict], key: str = "step_s") -> dict:
    """A case's speed-up over its baseline (both lists of repeat_row) on `key`: `mean`, the ratio of the means over
    the repeats both finished, and per pair (repeat k of each: run next to each other) `min`, `max` and `pairs` (the
    list). On step_s the baseline's over the case's; on a rate (tokens_per_s) the case's over the baseline's: with
    natural stop the two sides may generate different numbers of tokens, so the two ratios can differ. `median`: the
    median of the pairs, which a slow run on one side moves less than the ratio of the means."""
    base, case = _finished(baseline, key), _finished(runs, key)
    if not base or not case:
        return {}
    ratio = _ratio(key)
    pairs = _pairs(baseline, runs, key)
    both = base.keys() & case.keys() or base.keys() | case.keys()  # the repeats both finished: the same conditions
    found = {"mean": ratio(fmean(base[k] for k in both if k in base), fmean(case[k] for k in both if k in case))}
    if ratios := [p for p in pairs.values() if p is not None]:
        found.update(median=median(ratios), min=min(ratios), max=max(ratios))
        found["pairs"] = ", ".join(_num(p, "{:.3f}") or "–" for p in pairs.values())  # – : a run missing
    return found


def _finished(runs: list[dict], key: str) -> dict[int, float]:
    return {r["repeat"]: r[key] for r in runs if r["status"] == "finished" and r.get(key)}


def _ratio(key: str):
    """On step time the baseline's over the case's; on a rate the case's over the baseline's."""
    return (lambda b, c: b / c) if key == "step_s" else (lambda b, c: c / b)


def _pairs(baseline: list[dict], runs: list[dict], key: str = "step_s") -> dict[int, float | None]:
    """Each repeat's speed-up over the baseline's repeat of the same number (None where either did not finish)."""
    base, case = _finished(baseline, key), _finished(runs, key)
    ratio = _ratio(key)
    return {k: ratio(base[k], case[k]) if k in base and k in case else None for k in sorted(base.keys() | case.keys())}


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
    found, versus, each = tables_of(out, study)
    table = pd.DataFrame(found, columns=list(COLUMNS))
    table.to_csv(csv, index=False, float_format="%.4g")
    written = [csv]
    if versus:
        versus = pd.DataFrame(versus, columns=list(SPEEDUP_COLUMNS))
        versus.to_csv(out / "speedups.csv", index=False, float_format="%.4g")
        written.append(out / "speedups.csv")
    plots.study_figure(table).savefig(figure, dpi=120)
    md.write_text(markdown(out, study, table, bench_rows(out), versus if len(versus) else None, each))
    for path in (*written, md, figure):
        print(path)
    return [*written, md, figure, *(learning.report(out, study) if study.get("learning") else [])]


def one_run_per_case(out: Path) -> bool:
    """A study made before studies repeated their cases: each case's one job named by the launcher, no rep<k>."""
    return any(out.glob("runs/*/*/*/" + run_files.JOB)) and not any(out.glob("runs/*/*/rep*/" + run_files.JOB))


def markdown(out: Path, study: dict, table, benches: list[dict], versus=None, runs: list[dict] = ()) -> str:
    """results.md from the tables (COLUMNS, SPEEDUP_COLUMNS and the runs of tables_of)."""
    lines = [f"# Study results: {out.name}", "", *environment_lines(out)]
    flagged = {(r["model"], r["case"]) for r in runs if r["code"]}

    def case(r, name: str = "case") -> str:
        return r[name] + (f" {FLAG}" if (r["model"], r[name]) in flagged else "")

    if isinstance(study["baseline"], dict):
        pairs = ", ".join(f"`{case}` against `{base}`" for case, base in study["baseline"].items())
        baseline = f"speed-ups: {pairs}"
    else:
        baseline = f"baseline for speed-ups: `{study['baseline']}`"
    warmup = study["warmup_steps"]
    single = one_run_per_case(out)
    if single:
        conditions = f"one run per case (made before studies repeated their cases); its first {_steps(warmup)} left out"
        step_header = "step s (min–max)"
        explained = "Steady-state means over the steps after warm-up, with the fastest and slowest of those steps."
    else:
        conditions = (
            f"{_runs(study['repeats'])} per case, interleaved (run 1 of every case in the order listed, then run 2, …: "
            f"a case and its baseline ran next to each other); the first {_steps(warmup)} of every run left out"
        )
        step_header = "step s (runs min–max)"
        explained = (
            "Step s: the mean over a case's runs of each run's steady-state mean (steps after warm-up), in brackets "
            "the lowest and highest run mean. Speed-up: the baseline's mean step time / the case's, in brackets the "
            "lowest and highest of the pairs (run k of the case against run k of its baseline); Speed-ups gives the "
            "median of the pairs, on step time and on tokens/s."
        )
    lines += [
        f"- Definition: `study.yaml` in this directory ({baseline})",
        f"- Conditions: {conditions}",
        "",
        explained,
        "Kind: `ours` runs train.py; `plain_trl` the same workload through an unmodified TRL GRPOTrainer",
        "(bench/plain_trl.py), measured by the same instruments. tok/s/GPU counts every GPU used (the server's too).",
        "Peak GB: the most any GPU held (a server's included); GB while training / generating: the most a training GPU",
        "held during the train / generate phase (sleep mode hands vLLM's share to training, and back for generation).",
        *_flag_legend(flagged),
        "",
        f"| model | case | kind | GPUs | runs | {step_header} | gen s | sync s | sleep/wake s | train s | tok/s/GPU | "
        "speed-up | util gen % | util train % | peak GB | GB while training | GB while generating |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for _, r in table.iterrows():
        low, high = ("step_s_min", "step_s_max") if single else ("step_s_spread_min", "step_s_spread_max")
        step = _num(r["step_s"], "{:.3f}") + _range(r[low], r[high])
        speedup = _num(r["speedup_vs_baseline"], "{:.2f}×")
        if not single:
            speedup += _range(r["speedup_min"], r["speedup_max"])
        cells = [
            r["model"],
            case(r) + ("" if r["status"] == "finished" else f" ({r['status']})"),
            r["kind"],
            _gpus(r),
            _num(r["repeats"], "{:.0f}"),
            step,
            *(_num(r[k], "{:.3f}") for k in ("generate_s", "sync_weights_s", "sleep_wake_s", "train_s")),
            _num(r["tokens_per_s_per_gpu"], "{:,.0f}"),
            speedup,
            *(_num(r[k], "{:.0f}") for k in ("util_generate", "util_train")),
            *(_num(r[k], "{:.1f}") for k in ("peak_gb", "train_mem_gb", "gen_mem_gb")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    unfinished = table[~table["status"].isin(["finished", "not run"])]
    if len(unfinished):
        lines += ["", "## Runs that did not finish", "", "What each printed (the error its job recorded):", ""]
        lines += ["| model | case | status | error |", "|---|---|---|---|"]
        for _, r in unfinished.iterrows():
            note = "none recorded: see its job.log" if tables.missing(r["note"]) else r["note"]
            note = str(note).replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {r['model']} | {case(r)} | {r['status']} | {note} |")
    if versus is not None:
        lines += [
            "",
            "## Speed-ups",
            "",
            "Each case against each of its baselines, on step time and on tokens/s (with natural stop the two sides",
            "may generate different numbers of tokens: tokens per step shows it): the median of the pairs (run k",
            "against run k), in brackets the lowest and highest pair, then the ratio of the means.",
            "",
            "| model | case | against | tokens / step | baseline tokens / step | on step time: median (pairs) | means |"
            " on tokens/s: median (pairs) | means |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for _, r in versus.iterrows():
            cells = [
                *(r["model"], case(r), case(r, "baseline")),
                *(_num(r[k], "{:,.0f}") for k in ("tokens_per_step", "baseline_tokens_per_step")),
                *_speedup_cells(r, "step_speedup"),
                *_speedup_cells(r, "tokens_per_s_speedup"),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    if not single and runs:
        lines += [
            "",
            "## Runs",
            "",
            "Each run: its steady-state step time and tokens/s, its completions' lengths in tokens (the steady-state",
            "means of each step's mean, median and 99th percentile, and of the share cut at the cap; – where not",
            "logged), its speed-up over the run of its baseline next to it, the host's 1-minute load average at its",
            "start, at its highest and at its end (the run's own processes included; recorded from the study's",
            "env.json where it has them), and the code it ran where that was not its commit's.",
            "",
            "| model | case | run | step s | tokens/s | tokens: mean, p50, p99 | at the cap | speed-up of the pair | "
            "host load: start, peak, end | code |",
            "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for r in runs:
            cells = [
                *(r["model"], case(r), str(r["repeat"])),
                _num(r["step_s"], "{:.3f}") or r["status"],
                _num(r["tokens_per_s"], "{:,.0f}"),
                _lengths(r),
                _num(r["clipped_ratio"], "{:.1%}"),
                _num(r["speedup"], "{:.2f}×"),
                _load(r["load_average"]),
                f"{FLAG} {r['code']}" if r["code"] else "",
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
            f"| {r['model']} | {case(r)} | {_num(r['gen_tokens_per_s_per_engine'], '{:,.0f}')} | "
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
    lines += ["", "## Commands", ""]
    if not single:
        lines += ["From the checkout's root, in this order (each run one job: OUT/runs/MODEL/CASE/rep<k>):", ""]
    lines.append("```")
    for model in study["models"]:
        for repeat in [None] if single else range(1, study["repeats"] + 1):
            for case in cases_of(study, model):
                command = case_command(study, model, case, Path("OUT/runs") / model / case, REPO, repeat)
                lines.append(shlex.join(["python", *command[1:]]).replace(str(REPO) + "/", ""))
        for name, args in study["bench"].items():
            command = bench_command(model, args, Path("OUT/bench") / model / f"{name}.json")
            lines.append(shlex.join(["python", *command[1:]]))
    lines += ["```", "", "![step time by phase and throughput](study.png)", ""]
    return "\n".join(lines)


def _flag_legend(flagged: set) -> list[str]:
    if not flagged:
        return []
    return [
        "",
        f"{FLAG} ran on code that is not its commit's (a trial run, uncommitted changes, or a tree whose state is",
        "unknown; the environment lines above and each run under Runs say which): not a result of the commit named.",
    ]


def _speedup_cells(r, name: str) -> list[str]:
    """The median of the pairs with the lowest and highest pair, and the ratio of the means, of a speed-up."""
    found = _num(r[f"{name}_median"], "{:.2f}×")
    return [found + _range(r[f"{name}_min"], r[f"{name}_max"]) if found else "", _num(r[name], "{:.2f}×")]


def _lengths(run: dict) -> str:
    """A run's mean, median and 99th-percentile completion length (– where not logged; nothing for no steps)."""
    shown = [_num(run[key], "{:.0f}") for key in ("mean_length", "p50_length", "p99_length")]
    return ", ".join(cell or "–" for cell in shown) if any(shown) else ""


def _load(load: dict | None) -> str:
    if not load:
        return "not recorded"
    values = [(load.get("start") or [None])[0], load.get("peak_1min"), (load.get("end") or [None])[0]]
    return ", ".join(_num(x, "{:.2f}") or "?" for x in values)


def _runs(n: int) -> str:
    return "one run" if n == 1 else f"{n} runs"


def _steps(n: int) -> str:
    return "step" if n == 1 else f"{n} steps"


def _range(low, high) -> str:
    return "" if tables.missing(low) or tables.missing(high) else f" ({low:.2f}–{high:.2f})"


def _gpus(row) -> str:
    train, used = row["train_gpus"], row["gpus"]
    if tables.missing(train) or tables.missing(used):
        return ""
    serve = int(used) - int(train)
    return f"{int(train)}" + (f"+{serve} serve" if serve else "")


def _num(value, fmt: str) -> str:
    return "" if tables.missing(value) else fmt.format(value)
