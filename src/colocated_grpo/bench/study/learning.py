"""The learning report of a study with `learning` (and usually `seeds`): does a placement or a fast path change what
the policy learns, or only how fast? learning.csv (one row per model, case and seed: first and final reward, the
smallest grad norm), learning.md (each case's final reward against the seed spread of the identity pair's first case;
the identity pair beside the control pair — the same configuration twice — step by step at each seed; the verdicts)
and learning.png (reward over step, the seeds' range shaded)."""

from __future__ import annotations

from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING

from colocated_grpo import run_files
from colocated_grpo.bench.study.definition import environment_lines, repeat_dirs
from colocated_grpo.run_files import STEP_KEY, read_json, read_jsonl

if TYPE_CHECKING:  # matplotlib is the notebooks extra: the study CLI checks for it before drawing
    from matplotlib.figure import Figure

# Compared step by step between the identity pair and the control pair.
COMPARED = ("reward", "loss", "grad_norm", "sampling/sampling_logp_difference/mean")
COLUMNS = ("model", "case", "seed", "status", "steps", "first_reward", "final_reward", "min_grad_norm")


def seed_of(study: dict, repeat: int) -> int | str:
    """The seed repeat `repeat` ran with: the study's seeds, else the config's (the same for every repeat)."""
    return study["seeds"][repeat - 1] if study.get("seeds") else f"rep{repeat}"


def runs(out: Path, study: dict, model: str, case: str) -> dict:
    """seed → {status, metrics: step → that step's logged metrics} for each repeat of a case that ran."""
    found = {}
    for k, job_dir in repeat_dirs(out / "runs" / model / case).items():
        status = (read_json(job_dir / run_files.JOB) or {}).get("status", "not run")
        steps = {m[STEP_KEY]: m for m in read_jsonl(job_dir / run_files.METRICS) if "reward" in m}
        found[seed_of(study, k)] = {"status": status, "metrics": dict(sorted(steps.items()))}
    return found


def finished_seeds(case_runs: dict) -> set:
    """The seeds at which a case's run finished (case_runs: as `runs` returns them)."""
    return {seed for seed, run in case_runs.items() if run["status"] == "finished"}


def seed_row(model: str, case: str, seed, run: dict, final_steps: int) -> dict:
    rewards = [m["reward"] for m in run["metrics"].values()]
    grads = [m["grad_norm"] for m in run["metrics"].values() if m.get("grad_norm") is not None]
    return {
        "model": model,
        "case": case,
        "seed": seed,
        "status": run["status"],
        "steps": len(rewards),
        "first_reward": fmean(rewards[:final_steps]) if rewards else None,
        "final_reward": fmean(rewards[-final_steps:]) if rewards else None,
        "min_grad_norm": min(grads) if grads else None,
    }


def differences(a: dict, b: dict) -> dict[str, dict]:
    """Per COMPARED metric, over the steps both runs logged: the largest and the mean |a − b|."""
    steps = sorted(a["metrics"].keys() & b["metrics"].keys())
    found = {}
    for metric in COMPARED:
        pairs = [(a["metrics"][s].get(metric), b["metrics"][s].get(metric)) for s in steps]
        gaps = [abs(x - y) for x, y in pairs if x is not None and y is not None]
        if gaps:
            found[metric] = {"max": max(gaps), "mean": fmean(gaps)}
    return found


def verdict_identity(identity: dict, control: dict) -> str:
    """identity and control: metric → the largest |Δ| over every seed and step. Per metric: identical, within the
    control pair's run-to-run spread, or the largest difference beside the control's."""
    same = [f"`{m}`" for m, v in identity.items() if v == 0]
    within = [f"`{m}`" for m, v in identity.items() if 0 < v <= control.get(m, 0)]
    larger = [
        f"`{m}` by at most {v:.3g} (control pair: {control.get(m, 0):.3g})"
        for m, v in identity.items()
        if v > control.get(m, 0)
    ]
    parts = [
        *([f"identical at every step for {', '.join(same)}"] if same else []),
        *([f"within the control pair's run-to-run spread for {', '.join(within)}"] if within else []),
        *([f"different for {'; '.join(larger)}"] if larger else []),
    ]
    return "; ".join(parts) or "not compared (no step in common)"


def report(out: Path, study: dict) -> list[Path]:
    """Write OUT/learning.csv, learning.md and learning.png; returns their paths."""
    import pandas as pd

    learning = study["learning"]
    final_steps = learning["final_steps"]
    found = {(m, c): runs(out, study, m, c) for m in study["models"] for c in study["cases"]}
    table = pd.DataFrame(
        [seed_row(m, c, seed, run, final_steps) for (m, c), seeds in found.items() for seed, run in seeds.items()],
        columns=list(COLUMNS),
    )
    csv, md, png = out / "learning.csv", out / "learning.md", out / "learning.png"
    table.to_csv(csv, index=False, float_format="%.5g")
    figure(found, study).savefig(png, dpi=120)
    md.write_text(markdown(out, study, table, found))
    for path in (csv, md, png):
        print(path)
    return [csv, md, png]


def markdown(out: Path, study: dict, table, found: dict) -> str:
    learning = study["learning"]
    reference, compared = learning["identity"]
    control = learning["control"]
    final_steps = learning["final_steps"]
    seeds = ", ".join(map(str, study["seeds"])) if study.get("seeds") else f"one per run ({study['repeats']} runs)"
    lines = [
        f"# Learning: {out.name}",
        "",
        *environment_lines(out),
        f"- Definition: `study.yaml` in this directory; commands in results.md; seeds {seeds}",
        f"- Final reward: the mean reward of a run's last {final_steps} steps; first reward: of its first "
        f"{final_steps}.",
        "",
    ]
    done = table[table["status"] == "finished"]
    for model in study["models"]:
        rows = done[done["model"] == model]
        ref = rows[rows["case"] == reference].set_index("seed")["final_reward"]
        lines += [
            f"## {model}: final reward by case",
            "",
            f"Against `{reference}`'s seeds (range {_range(ref)}): a case whose range of final rewards overlaps it "
            f"learns the same within the seed spread. Δ: the mean difference from `{reference}` at the seeds both ran.",
            "",
            "| case | seeds | first reward | final reward (seeds min–max) | final reward per seed | "
            f"Δ vs `{reference}` | smallest grad norm | verdict |",
            "|---|---:|---:|---:|---|---:|---:|---|",
        ]
        for case in study["cases"]:
            own = rows[rows["case"] == case].set_index("seed")
            if own.empty:
                lines.append(f"| {case} | 0 |  |  |  |  |  | did not finish |")
                continue
            final = own["final_reward"]
            common = final.index.intersection(ref.index)
            delta = f"{(final[common] - ref[common]).mean():+.3f}" if len(common) else ""
            overlaps = not ref.empty and final.min() <= ref.max() and ref.min() <= final.max()
            verdict = "reference" if case == reference else ("within the seed spread" if overlaps else "differs")
            per_seed = ", ".join(f"{seed}: {value:.3f}" for seed, value in final.items())
            lines.append(
                f"| {case} | {len(own)} | {own['first_reward'].mean():.3f} | {final.mean():.3f} ({_range(final)}) | "
                f"{per_seed} | {delta} | {own['min_grad_norm'].min():.3g} | {verdict} |"
            )
        lines += ["", *identity_lines(model, found, reference, compared, control)]
    lines += ["![reward over step, the seeds' range shaded](learning.png)", ""]
    return "\n".join(lines)


def identity_lines(model: str, found: dict, reference: str, compared: str, control: list[str]) -> list[str]:
    """The identity pair beside the control pair at each seed both ran: the largest and mean |Δ| per metric, the
    verdict over all seeds, then the first seed's steps side by side."""
    pairs = {"identity": (reference, compared), "control": tuple(control)}
    finished = {case: finished_seeds(found[(model, case)]) for case in {reference, compared, *control}}
    both = {name: sorted(finished[a] & finished[b], key=str) for name, (a, b) in pairs.items()}
    lines = [
        f"## {model}: `{reference}` against `{compared}` at the same seed, beside the control pair "
        f"`{control[0]}` / `{control[1]}`",
        "",
    ]
    if not both["identity"]:
        return [*lines, f"No seed at which both `{reference}` and `{compared}` finished.", ""]
    lines += ["| seed | pair | " + " | ".join(f"{m} max / mean \\|Δ\\|" for m in COMPARED) + " |"]
    lines.append("|---|---|" + "---:|" * len(COMPARED))
    largest = {name: {} for name in pairs}
    for seed in sorted(set(both["identity"]) | set(both["control"]), key=str):
        for name, (a, b) in pairs.items():
            if seed not in both[name]:
                continue
            gaps = differences(found[(model, a)][seed], found[(model, b)][seed])
            for metric, gap in gaps.items():
                largest[name][metric] = max(largest[name].get(metric, 0), gap["max"])
            cells = [f"{gaps[m]['max']:.3g} / {gaps[m]['mean']:.3g}" if m in gaps else "" for m in COMPARED]
            lines.append(f"| {seed} | {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Verdict: `{reference}` against `{compared}` (seeds {', '.join(map(str, both['identity']))}; control pair at "
        f"seeds {', '.join(map(str, both['control'])) or 'none'}): {verdict_identity(*largest.values())}.",
        "",
    ]
    seeds = [s for s in both["identity"] if s in both["control"]] or both["identity"]
    first = seeds[0]
    cases = [c for c in dict.fromkeys([reference, compared, *control]) if first in finished[c]]
    metrics = [found[(model, c)][first]["metrics"] for c in cases]
    lines += [f"Step by step at seed {first} (reward, loss, grad norm, sampling log-prob difference):", ""]
    labels = ("reward", "loss", "grad norm", "logp diff")  # COMPARED, shorter
    lines.append("| step | " + " | ".join(f"{label} ({c})" for label in labels for c in cases) + " |")
    lines.append("|---:|" + "---:|" * (4 * len(cases)))
    for step in sorted(set.union(*(set(m) for m in metrics))):
        cells = [_cell(m.get(step, {}).get(key)) for key in COMPARED for m in metrics]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def figure(found: dict, study: dict) -> Figure:
    """Per model: the mean reward over step of each case, its seeds' lowest and highest shaded, over the seeds every
    case finished (so that the curves compare the same seeds); curves that coincide show as dashes over a line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 4.0 * len(study["models"])), layout="constrained")
    axes = fig.subplots(len(study["models"]), 1, squeeze=False)[:, 0]
    styles = [("-", 3.0), ("--", 2.2), (":", 2.2), ("-.", 1.6), ("-", 1.0)]
    for ax, model in zip(axes, study["models"], strict=True):
        finished = {case: finished_seeds(found[(model, case)]) for case in study["cases"]}
        common = set.intersection(*finished.values()) if finished else set()
        for i, case in enumerate(study["cases"]):
            seeds = [found[(model, case)][s]["metrics"] for s in sorted(common or finished[case], key=str)]
            if not seeds:
                continue
            steps = sorted(set.intersection(*(set(s) for s in seeds)))
            values = [[s[step]["reward"] for s in seeds] for step in steps]
            style, width = styles[i % len(styles)]
            (line,) = ax.plot(steps, [fmean(v) for v in values], style, linewidth=width, label=case)
            ax.fill_between(
                steps, [min(v) for v in values], [max(v) for v in values], alpha=0.15, color=line.get_color()
            )
        shown = f"seeds {', '.join(map(str, sorted(common, key=str)))}" if common else "each case's own seeds"
        ax.set_xlabel("train/global_step")
        ax.set_ylabel("reward (mean over seeds)")
        ax.set_title(f"{model}: reward over step ({shown}; lowest to highest shaded)", fontsize=10)
        ax.legend(fontsize=8)
    return fig


def _range(values) -> str:
    return f"{values.min():.3f}–{values.max():.3f}" if len(values) else "none"


def _cell(value) -> str:
    return "" if value is None else f"{value:.4g}"
