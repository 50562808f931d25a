"""Trainer callbacks: the per-step run files (metrics.jsonl, summary.json), the telemetry that feeds them, and the
line each step prints."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from accelerate.utils import gather_object
from transformers import PrinterCallback, ProgressCallback, TrainerCallback

from colocated_grpo import run_files
from colocated_grpo.compat import trl as trl_internals
from colocated_grpo.run_files import STEP_KEY, JsonlWriter, read_json, read_jsonl, write_json
from colocated_grpo.telemetry import aggregate, nvml
from colocated_grpo.telemetry.phases import PhaseTracker, TokenCounter

log = logging.getLogger(__name__)

# Dense bf16 peak of one GPU, for perf/mfu; other GPUs: set telemetry.peak_tflops.
PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}


class MetricsFileCallback(TrainerCallback):
    """Rank 0: each logged step to metrics.jsonl, keyed by `train/global_step` like the W&B run, with `step_metrics()`
    (the step's telemetry); summary.json kept current; the trainer's totals: trainer_summary.json."""

    def __init__(self, run_dir: Path, warmup_steps: int = 1, step_metrics: Callable[[], dict] | None = None):
        self.run_dir, self.step_metrics = run_dir, step_metrics
        self.steady = aggregate.SteadyState(warmup_steps)
        self.writer: JsonlWriter | None = None
        self.last: dict = {}  # the record of the latest step (StepLine prints it)
        self.start_step = 0  # the step this attempt started from (a resume's checkpoint step)

    def on_train_begin(self, args, state, control, **kwargs):
        self.start_step = state.global_step  # the checkpoint's state is loaded by now

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "train_runtime" in logs:
            write_json(self.run_dir / run_files.TRAINER_SUMMARY, {STEP_KEY: state.global_step, **logs})
            return
        if self.writer is None:
            path = self.run_dir / run_files.METRICS
            # each attempt warms up again (run.json holds every attempt's start, this one's included)
            run = read_json(self.run_dir / run_files.RUN) or {}
            self.steady.starts = sorted({0, self.start_step, *(a.get("from_step", 0) for a in run.get("attempts", []))})
            # a resumed run keeps the steps before its checkpoint (the file was cut back to them) in its summary
            for earlier in read_jsonl(path):
                self.steady.add(earlier)
            self.writer = JsonlWriter(path)
        record = {STEP_KEY: state.global_step, **logs}
        if self.step_metrics is not None:
            record.update(self.step_metrics())
        self.writer.write(record)
        self.last = record
        self.steady.add(record)
        summary = self.steady.summary()
        write_json(self.run_dir / run_files.SUMMARY, summary)
        import wandb

        if wandb.run is not None:
            wandb.run.summary.update(summary)

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class TelemetryCallback(TrainerCallback):
    """Phase times, GPU samples and throughput of every step on every rank, aggregated on rank 0."""

    sampler: nvml.GpuSampler | None = None
    samples_writer = phases_writer = None  # JsonlWriters, on rank 0
    n_params: int | None = None

    def __init__(self, trainer, run_dir: Path, interval_s: float = 0.2, sync_cuda: bool = True, peak_tflops=None):
        import torch

        self.trainer, self.run_dir, self.interval_s, self.peak_tflops = trainer, run_dir, interval_s, peak_tflops
        self.cuda = torch.cuda.is_available()
        self.tracker = PhaseTracker(barrier=torch.cuda.synchronize if (self.cuda and sync_cuda) else None)
        self.tokens = TokenCounter()
        trainer.time_phases(self.tracker, self.tokens)  # compat.grpo_trainer.TimedGRPOTrainer and its subclasses
        self.pending: dict[str, float] = {}
        self.constants: dict[str, float] = {}  # logged with every step: model size, KV-cache capacity

    def on_train_begin(self, args, state, control, **kwargs):
        import torch

        why_not = nvml.unavailable() if self.cuda else "torch sees no CUDA device"
        if why_not is None:
            device = torch.cuda.current_device()
            gpus = {str(self.trainer.accelerator.process_index): nvml.cuda_device_uuid(device)}
            if state.is_world_process_zero:  # a vLLM server's GPUs (server placement) are sampled by rank 0
                server_gpus = [g for g in os.environ.get(nvml.SERVER_GPUS_ENV, "").split(",") if g]
                gpus.update({f"server{j}": uuid for j, uuid in enumerate(server_gpus)})
            self.sampler = nvml.GpuSampler(gpus, self.interval_s).start()
            if self.peak_tflops is None:
                name = torch.cuda.get_device_name(device)
                self.peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        elif state.is_world_process_zero:
            log.warning("no GPU metrics: %s; logging phase timings and throughput only", why_not)
        self.n_params = sum(getattr(p, "ds_numel", p.numel()) for p in self.trainer.model.parameters())
        self.constants = {"model/params": float(self.n_params)}
        if (kv_tokens := trl_internals.kv_cache_tokens(self.trainer)) is not None:
            self.constants["vllm/kv_cache_tokens"] = float(kv_tokens)
        if state.is_world_process_zero:
            self.samples_writer = JsonlWriter(self.run_dir / run_files.GPU_SAMPLES)
            self.phases_writer = JsonlWriter(self.run_dir / run_files.PHASES)

    def on_train_end(self, args, state, control, **kwargs):
        if self.sampler is not None:
            self.sampler.stop()
        for writer in (self.samples_writer, self.phases_writer):
            if writer is not None:
                writer.close()

    def on_step_begin(self, args, state, control, **kwargs):
        self.tracker.begin_step()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.tracker.enter("train")

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.tracker.exit("train")

    def on_step_end(self, args, state, control, **kwargs):
        t0 = time.perf_counter()
        barrier_s, self.tracker.barrier_s = self.tracker.barrier_s, 0.0
        phases = self.tracker.end_step()
        if phases is None:
            return
        samples = self.sampler.take(phases.start, phases.end) if self.sampler else []
        lengths = self.tokens.lengths
        prompt, completion = self.tokens.reset()
        rank = self.trainer.accelerator.process_index
        report = aggregate.RankReport(rank, phases, samples, prompt, completion, lengths)
        reports = gather_object([report])  # every rank's, in rank order; [report] on one process
        if not state.is_world_process_zero:
            return
        metrics = aggregate.step_metrics(reports, self.n_params if self.cuda else None, self.peak_tflops)
        for r in reports:
            row = {STEP_KEY: state.global_step, "rank": r.rank}
            for seg in r.phases.segments:  # the step's timeline: what each rank did when (same clock as samples)
                self.phases_writer.write({**row, "phase": seg.phase, "start": seg.start, "end": seg.end})
            for sample, phase in r.labelled:
                self.samples_writer.write({**row, "phase": phase, **sample.__dict__})
        metrics.update(self.constants)
        metrics["telemetry/barrier_s"] = barrier_s
        metrics["telemetry/callback_s"] = time.perf_counter() - t0
        if self.sampler is not None:
            metrics["telemetry/sampler_s"] = self.sampler.read_s
            self.sampler.read_s = 0.0
        self.pending = metrics
        import wandb

        if wandb.run is not None:
            wandb.run.log({**metrics, STEP_KEY: state.global_step})

    def pop_step_metrics(self) -> dict[str, float]:
        metrics, self.pending = self.pending, {}
        return metrics


PHASES_SHOWN = ("generate", "train")  # the two that dominate a GRPO step; all of them are in metrics.jsonl
_GPU_UTIL = re.compile(r"gpu/[^/]+/util")  # per GPU (gpu/0/util, gpu/server0/util), not per phase (gpu/util_train)


def install_step_line(trainer, metrics_file) -> None:
    """Swap transformers' printing of the logs (ProgressCallback, PrinterCallback) for the step line (every rank: only
    rank 0 prints either)."""
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
        if ahead := m.get("timing_s/generate_overlapped"):  # placement.overlap: this batch, beside the step before
            phases += f"; its batch generated ahead in {ahead:.2f}"
        parts.append(f"{seconds:.2f} s" + (f" ({phases})" if phases else ""))
    if (rate := m.get("perf/tokens_per_s_per_gpu")) is not None:
        parts.append(f"{rate:,.0f} tok/s/GPU")
    elif m.get("perf/tokens") == 0:  # trainer.num_iterations > 1: trained on an earlier step's generation
        parts.append("generation reused")
    if utils := [v for k, v in m.items() if _GPU_UTIL.fullmatch(k) and v is not None]:
        parts.append(f"GPU {sum(utils) / len(utils):.0f} %")
    return " | ".join(parts)


class StepLine(TrainerCallback):
    """Prints each logged step's line (rank 0), as nanoGPT and veRL print theirs, only the parts the step has:

        step 2/3 | reward 0.41 | 1.92 s (generate 1.10, train 0.61) | 812 tok/s/GPU | GPU 63 %

    It reads MetricsFileCallback's record; the trainer's dict goes to train.log under the same line."""

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
