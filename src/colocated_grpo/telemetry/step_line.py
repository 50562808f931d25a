"""What a run prints while it trains: one line per logged step on rank 0, as nanoGPT and veRL print theirs,

    step 2/3 | reward 0.41 | 1.92 s (generate 1.10, train 0.61) | 812 tok/s/GPU | GPU 63 %

(only the parts the step has). It replaces transformers' progress bar and metrics dict (ProgressCallback,
PrinterCallback); the dict goes to train.log under the same line, every number to metrics.jsonl."""

from __future__ import annotations

import logging
import re

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from colocated_grpo import run_files

log = logging.getLogger(__name__)

PHASES_SHOWN = ("generate", "train")  # the two that dominate a GRPO step; all of them are in metrics.jsonl
_GPU_UTIL = re.compile(r"gpu/[^/]+/util")  # per GPU (gpu/0/util, gpu/server0/util), not per phase (gpu/util_train)


def install(trainer, metrics_file) -> None:
    """Swap transformers' printing of the logs for the step line (every rank: only rank 0 prints either)."""
    for printer in (ProgressCallback, PrinterCallback):
        trainer.remove_callback(printer)
    trainer.add_callback(StepLine(metrics_file))


def format_line(step: int, max_steps: int, m: dict) -> str:
    """The step's line from its record in metrics.jsonl (TRL's logs and our telemetry)."""
    parts = [f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}"]
    if (reward := m.get("reward")) is not None:
        parts.append(f"reward {reward:.3g}")
    if (seconds := m.get("timing_s/step", m.get("step_time"))) is not None:  # TRL's own step timer without ours
        phases = ", ".join(f"{p} {m[f'timing_s/{p}']:.2f}" for p in PHASES_SHOWN if f"timing_s/{p}" in m)
        parts.append(f"{seconds:.2f} s" + (f" ({phases})" if phases else ""))
    if (rate := m.get("perf/tokens_per_s_per_gpu")) is not None:
        parts.append(f"{rate:,.0f} tok/s/GPU")
    elif m.get("perf/tokens") == 0:  # trainer.num_iterations > 1: trained on an earlier step's generation
        parts.append("generation reused")
    if utils := [v for k, v in m.items() if _GPU_UTIL.fullmatch(k) and v is not None]:
        parts.append(f"GPU {sum(utils) / len(utils):.0f} %")
    return " | ".join(parts)


class StepLine(TrainerCallback):
    """Prints each logged step's line (rank 0), logged with the trainer's dict; reads MetricsFileCallback's record."""

    def __init__(self, metrics_file):
        self.metrics_file = metrics_file

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items() if k != "total_flos"}
        if "train_runtime" in logs:  # the trainer's totals: the end-of-run summary says what matters of them
            run_files.log_to_files(log, logging.INFO, f"trainer totals: {shown}")
            return
        line = format_line(state.global_step, state.max_steps, {**logs, **self.metrics_file.last})
        print(line, flush=True)
        run_files.log_to_files(log, logging.INFO, f"{line}\n{shown}")
