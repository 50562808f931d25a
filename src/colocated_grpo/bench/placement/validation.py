"""Predictions beside measured jobs: one row per job with the measured and predicted step time and phases, the
error, which phase missed most, and whether the job was part of the calibration (in-sample)."""

from __future__ import annotations

import statistics
from pathlib import Path

from colocated_grpo.bench.placement import calibration as calibration_file
from colocated_grpo.bench.placement import measured
from colocated_grpo.bench.placement.model import Placement, Workload, predict
from colocated_grpo.telemetry.phases import PHASES


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
        "completions": job.completions,
        "in_sample": calibration_file.source(job) in calibrated,
        "measured_s": job.step_s,
        **{f"measured_{p}": job.phases[p] for p in PHASES},
    }
    if why := _not_modelled(job):
        return {**row, "note": why}
    placement = Placement(job.placement, job.gpus, server_gpus=job.gpus - job.train_gpus, request=job.request)
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


def _not_modelled(job: measured.Job) -> str | None:
    if job.placement == "none":
        return "not modelled: transformers generate (no vLLM)"
    if job.tp > 1:
        return "not modelled: vLLM TP > 1 (one GPU cannot calibrate a TP group)"
    return None


def summary(table: list[dict], in_sample: bool = False) -> dict:
    errors = [abs(r["error"]) for r in table if "error" in r and r["in_sample"] == in_sample]
    if not errors:
        return {"cases": 0}
    return {"cases": len(errors), "median": statistics.median(errors), "max": max(errors)}


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
    for in_sample, label in ((False, "out of sample (multi-GPU)"), (True, "in-sample (the calibration's own runs)")):
        s = summary(table, in_sample)
        if s["cases"]:
            lines += ["", f"{label}: {s['cases']} jobs, |error| median {s['median']:.1%}, max {s['max']:.1%}"]
    return "\n".join(lines) + "\n"
