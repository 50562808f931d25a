"""The predictor's figures: predicted step time by phase per placement, and predicted against measured step time."""

from __future__ import annotations

from colocated_grpo.bench.placement.model import Prediction, Workload
from colocated_grpo.telemetry.phases import PHASES


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
    for in_sample, marker in ((False, "o"), (True, "x")):
        for placement, color in (("colocate", "tab:blue"), ("colocate_sleep", "tab:green"), ("server", "tab:red")):
            if chosen := [r for r in rows if r["in_sample"] == in_sample and r["placement"] == placement]:
                ax.scatter(
                    [r["measured_s"] for r in chosen],
                    [r["predicted_s"] for r in chosen],
                    marker=marker,
                    color=color,
                    label=f"{placement}{' (in-sample, 1 GPU)' if in_sample else ' (multi-GPU)'}",
                )
    ax.set(xlim=(0, top), ylim=(0, top), xlabel="measured step time, s", ylabel="predicted step time, s")
    ax.set_title("placement model: predicted vs measured (lines: 0, ±10 %, ±20 %)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
