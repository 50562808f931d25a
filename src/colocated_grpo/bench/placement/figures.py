"""The predictor's figures: predicted step time by phase per placement, predicted against measured step time, and
one GPU's step over batch and completion length."""

from __future__ import annotations

from colocated_grpo.bench.placement.model import Placement, Prediction, Workload, predict
from colocated_grpo.bench.placement.validation import GROUPS
from colocated_grpo.telemetry.phases import PHASES

SCALING_BATCHES = (64, 128, 256, 512, 1024)
SCALING_LENGTHS = (256, 1024)
ONE_GPU = {"colocate": Placement("colocate", 1), "colocate_sleep": Placement("colocate_sleep", 1)}
VALIDATION_MARKERS = {  # each validation group (validation.GROUPS): its legend label and marker, in legend order
    "in-sample (the calibration's own runs)": ("in-sample, 1 GPU", "x"),
    "held out (one GPU, not calibrated from)": ("held out, 1 GPU", "s"),
    "out of sample (multi-GPU)": ("multi-GPU", "o"),
}


def ranking(predictions: list[Prediction], workload: Workload, title: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 0.5 * len(predictions) + 2.5))
    left, right = fig.subplots(1, 2)
    names = [p.placement.name + ("" if p.fits else " (does not fit)") for p in predictions]
    start = [0.0] * len(predictions)
    for phase in PHASES:
        widths = [p.phases[phase] for p in predictions]
        left.barh(names, widths, left=start, label=phase)
        start = [s + w for s, w in zip(start, widths, strict=True)]
    left.invert_yaxis()
    left.set_xlabel("predicted step time, s")
    left.legend(fontsize=8, loc="upper right")
    right.barh(names, [p.tokens_per_s_per_gpu(workload) for p in predictions], color="tab:gray")
    right.invert_yaxis()
    right.set_xlabel("predicted tokens/s per GPU used")
    right.set_yticklabels([])
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def validation(table: list[dict]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 6))
    ax = fig.subplots()
    rows = [r for r in table if "error" in r]
    top = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1.1
    for share, style in ((0.0, "-"), (0.1, "--"), (0.2, ":")):
        for sign in {1, -1}:
            ax.plot([0, top], [0, top * (1 + sign * share)], "k" + style, lw=0.7)
    for group, (label, marker) in VALIDATION_MARKERS.items():
        member = GROUPS[group]
        for placement, color in (("colocate", "tab:blue"), ("colocate_sleep", "tab:green"), ("server", "tab:red")):
            if chosen := [r for r in rows if member(r) and r["placement"] == placement]:
                ax.scatter(
                    [r["measured_s"] for r in chosen],
                    [r["predicted_s"] for r in chosen],
                    marker=marker,
                    color=color,
                    label=f"{placement} ({label})",
                )
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured step time, s", ylabel="predicted step time, s")
    ax.set_title("placement model: predicted vs measured (lines: 0, ±10 %, ±20 %)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def scaling_predictions(calibration: dict, params_b: float, prompt_tokens: float) -> dict:
    """(placement kind, completion length) → [(Workload, Prediction)] on one GPU, over SCALING_BATCHES."""
    found = {}
    for kind, placement in ONE_GPU.items():
        for length in SCALING_LENGTHS:
            workloads = [Workload(b, prompt_tokens, length, params_b) for b in SCALING_BATCHES]
            found[(kind, length)] = [(w, predict(calibration, w, placement)) for w in workloads]
    return found


def scaling(predicted: dict, measured: list[dict], title: str):
    """Top: tokens/s per GPU over batch, per completion length, colocate and colocate + sleep (lines predicted,
    markers measured one-GPU jobs, validation rows). Bottom: colocate's predicted step split into phases, its
    measured steps as black bars."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8))
    axes = fig.subplots(2, len(SCALING_LENGTHS), squeeze=False)
    styles = {"colocate": ("tab:blue", "o"), "colocate_sleep": ("tab:green", "s")}
    one_gpu = [r for r in measured if r["gpus"] == 1]
    for col, length in enumerate(SCALING_LENGTHS):
        top, bottom = axes[0][col], axes[1][col]
        at_length = [r for r in one_gpu if nearest_length(r["completion_tokens"]) == length]
        for kind, (color, marker) in styles.items():
            line = predicted[(kind, length)]
            top.plot(
                [w.completions for w, _ in line], [p.tokens_per_s_per_gpu(w) for w, p in line], color=color, label=kind
            )
            mine = [r for r in at_length if r["placement"] == kind]
            top.scatter([r["completions"] for r in mine], [_tokens_per_s(r) for r in mine], color=color, marker=marker)
        top.set(xscale="log", xlabel="completions per step", ylabel="tokens/s per GPU")
        top.set_xticks(SCALING_BATCHES, [str(b) for b in SCALING_BATCHES])
        top.set_title(f"{length}-token completions (lines: predicted; markers: measured)", fontsize=9)
        top.legend(fontsize=8)
        line = predicted[("colocate", length)]
        labels, base = [str(w.completions) for w, _ in line], [0.0] * len(line)
        for phase in PHASES:
            heights = [p.phases[phase] for _, p in line]
            bottom.bar(labels, heights, bottom=base, label=phase)
            base = [x + h for x, h in zip(base, heights, strict=True)]
        mine = [r for r in at_length if r["placement"] == "colocate" and str(r["completions"]) in labels]
        bottom.scatter(
            [str(r["completions"]) for r in mine],
            [r["measured_s"] for r in mine],
            color="k",
            marker="_",
            s=600,
            label="measured step",
        )
        bottom.set(xlabel="completions per step", ylabel="colocate: predicted step time, s")
        bottom.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def nearest_length(tokens: float) -> int:
    return min(SCALING_LENGTHS, key=lambda length: abs(length - tokens))


def _tokens_per_s(row: dict) -> float:
    return row["completions"] * (row["prompt_tokens"] + row["completion_tokens"]) / row["measured_s"] / row["gpus"]
