"""Predictions beside measured jobs: one row per job with the measured and predicted step time and phases, the
error, which phase missed most, and whether the job was part of the calibration (in-sample)."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path

from colocated_grpo.bench.placement import calibration as calibration_file
from colocated_grpo.bench.placement import measured
from colocated_grpo.bench.placement.model import Placement, Workload, predict, uncalibrated
from colocated_grpo.provenance import REPO
from colocated_grpo.telemetry.phases import PHASES

COMMITTED = REPO / "sweeps" / "results" / "placement_model" / "validation.csv"  # of the committed H200 calibration


def rows(calibration: dict, directories: list[str | Path]) -> list[dict]:
    calibrated = set(calibration.get("sources", []))
    return [_row(calibration, job, calibrated) for directory in directories for job in measured.load(directory)]


def _row(calibration: dict, job: measured.Job, calibrated: set[str]) -> dict:
    row = {
        "model": job.model,
        "case": job.case,
        "gpus": job.gpus,
        "placement": job.placement,
        "tp": job.tp,
        "mem": job.mem,
        "request": job.request,
        "one_forward": job.one_forward,
        "completions": job.completions,
        "params_b": job.params_b,
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "in_sample": calibration_file.source(job) in calibrated,
        "measured_s": job.step_s,
        **{f"measured_{p}": job.phases[p] for p in PHASES},
    }
    if why := _not_modelled(job, calibration):
        return {**row, "note": why}
    placement = Placement(
        job.placement,
        job.gpus,
        server_gpus=job.gpus - job.train_gpus,
        request=job.request,
        mem=None if job.placement == "server" else job.mem,
        one_forward=job.one_forward,
    )
    workload = Workload(job.completions, job.prompt_tokens, job.completion_tokens, job.params_b)
    prediction = predict(calibration, workload, placement)
    errors = {p: prediction.phases[p] - job.phases[p] for p in PHASES}
    worst = max(errors, key=lambda p: abs(errors[p]))
    return {
        **row,
        "predicted_s": prediction.step_s,
        **{f"predicted_{p}": prediction.phases[p] for p in PHASES},
        "error": prediction.step_s / job.step_s - 1,
        "worst_phase": worst,
        "worst_phase_error_s": errors[worst],
        "note": "; ".join(prediction.flags),
    }


def _not_modelled(job: measured.Job, calibration: dict) -> str | None:
    if why := uncalibrated(calibration, job.params_b):
        return f"not modelled: {why}"
    if job.training != "ddp":
        return f"not modelled: {job.training} (the model knows DDP training of every weight)"
    if job.placement == "none":
        return "not modelled: transformers generate (no vLLM)"
    if job.tp > 1:
        return "not modelled: vLLM TP > 1 (one GPU cannot calibrate a TP group)"
    return None


GROUPS = {  # how a job stands to the calibration: label → which rows
    "held out (one GPU, not calibrated from)": lambda r: not r["in_sample"] and r["gpus"] == 1,
    "out of sample (multi-GPU)": lambda r: not r["in_sample"] and r["gpus"] > 1,
    "in-sample (the calibration's own runs)": lambda r: r["in_sample"],
}


def summary(table: list[dict], group: str = "out of sample (multi-GPU)") -> dict:
    errors = [abs(r["error"]) for r in table if "error" in r and GROUPS[group](r)]
    if not errors:
        return {"cases": 0}
    return {"cases": len(errors), "median": statistics.median(errors), "max": max(errors)}


def committed(gpus: int) -> dict:
    """The |error| of the committed validation (sweeps/results/placement_model/validation.csv) for jobs not
    calibrated from on `gpus` GPUs: one GPU held out, or multi-GPU."""
    with open(COMMITTED) as f:
        table = [
            {**r, "in_sample": r["in_sample"] == "True", "gpus": int(r["gpus"]), "error": float(r["error"])}
            for r in csv.DictReader(f)
            if r["error"]
        ]
    return summary(table, next(label for label, rows in GROUPS.items() if rows({"in_sample": False, "gpus": gpus})))


def markdown(table: list[dict]) -> str:
    lines = [
        "| model | case | GPUs | request | measured s | predicted s | error | gen s meas → pred | sync s | train s | "
        "worst phase (pred − meas) | in-sample | note |",
        "|---|---|---:|---|---:|---:|---:|---|---|---|---|---|---|",
    ]
    for r in table:
        predicted = "| | | | | |"  # a job the model leaves out: no prediction
        if "error" in r:
            predicted = (
                f"{r['predicted_s']:.3f} | {r['error']:+.0%} | "
                + "".join(
                    f"{r[f'measured_{p}']:.2f} → {r[f'predicted_{p}']:.2f} | "
                    for p in ("generate", "sync_weights", "train")
                )
                + f"{r['worst_phase']} {r['worst_phase_error_s']:+.2f} s |"
            )
        lines.append(
            f"| {r['model']} | {r['case']} | {r['gpus']} | {r['request']} | {r['measured_s']:.3f} | {predicted} "
            f"{'yes' if r['in_sample'] else 'no'} | {r['note']} |"
        )
    for label in GROUPS:
        s = summary(table, label)
        if s["cases"]:
            lines += ["", f"{label}: {s['cases']} jobs, |error| median {s['median']:.1%}, max {s['max']:.1%}"]
    return "\n".join(lines) + "\n"
