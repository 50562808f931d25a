"""Measured jobs, read from a study directory (runs/<model>/<case>/, each a one-job sweep) or a sweep directory: what
each job did per step (completions, prompt and completion tokens, model size), where (placement, GPUs, TP, memory
share, which request and sync), and its steady-state phase times."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from colocated_grpo import run_files
from colocated_grpo.analysis import tables
from colocated_grpo.bench.placement.shapes import SHAPES
from colocated_grpo.compat.trl import generation_batch_size
from colocated_grpo.run_files import read_json
from colocated_grpo.telemetry.phases import PHASES


@dataclass
class Job:
    source: str  # the job's directory, as given
    model: str
    case: str
    placement: str  # colocate, colocate_sleep, server, none
    train_gpus: int
    gpus: int
    tp: int
    mem: float | None
    params_b: float
    completions: int  # per step, all ranks together
    prompt_tokens: float  # mean per completion
    completion_tokens: float  # mean per completion
    fast_outputs: bool
    fast_sync: bool
    one_forward: bool  # placement.one_forward: no extra no-grad forward over each generation batch
    step_s: float
    phases: dict[str, float] = field(default_factory=dict)
    kv_cache_tokens: float | None = None  # one engine's KV cache (colocated runs log it)
    training: str = "ddp"  # the parallelism, with `+ lora` when adapters train (the model knows DDP full weights)

    @property
    def request(self) -> str:
        """The engine request and sync the job used: `trl` (TRL's own), `fast` (ours) or `mixed`."""
        if self.placement in ("server", "none"):
            return "trl"  # server mode cannot ask for less (docs/running.md)
        if self.fast_outputs == self.fast_sync:
            return "fast" if self.fast_outputs else "trl"
        return "mixed"


def load(directory: str | Path) -> list[Job]:
    """Every finished job under a study directory (runs/*/*/) or a sweep directory."""
    directory = Path(directory)
    sweeps = sorted(p for p in directory.glob("runs/*/*") if p.is_dir()) or [directory]
    found = []
    for sweep in sweeps:
        for row in tables.load_jobs(sweep):
            if row["status"] == "finished" and row.get("timing_s/step"):
                tp, mem = row["vllm_tensor_parallel_size"], row["vllm_gpu_memory_utilization"]
                case = sweep.name if sweep != directory else f"{directory.name}: tp{tp:.0f}_mem{mem}"
                found.append(_job(sweep / row["dir"], row, case))
    return found


def _job(run_dir: Path, row: dict, case: str) -> Job:
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    summary = read_json(run_dir / run_files.SUMMARY) or {}
    trainer, placement = cfg["trainer"], cfg.get("placement", {})
    world = int(row["world_size"])
    completions = generation_batch_size(trainer, world)
    completion_tokens = float(summary.get("completions/mean_length") or trainer["max_completion_length"])
    tokens = summary.get("perf/tokens")
    prompt_tokens = tokens / completions - completion_tokens if tokens else 0.0
    build = cfg["model"].get("build") or Path(str(cfg["model"]["name_or_path"])).name
    return Job(
        source=str(run_dir),
        model=build,
        case=case,
        placement=row["placement"],
        train_gpus=world,
        gpus=int(row["gpus"]),
        tp=int(row["vllm_tensor_parallel_size"] or 1),
        mem=row["vllm_gpu_memory_utilization"],
        params_b=summary["model/params"] / 1e9 if summary.get("model/params") else SHAPES[build].params_b,
        completions=completions,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        fast_outputs=bool(placement.get("fast_outputs", False)),  # a run without these keys used TRL's own
        fast_sync=bool(placement.get("fast_sync", False)),
        one_forward=bool(placement.get("one_forward", False)),
        step_s=row["timing_s/step"],
        phases={p: row.get(f"timing_s/{p}") or 0.0 for p in PHASES},
        kv_cache_tokens=summary.get("vllm/kv_cache_tokens"),
        training=_training(cfg),
    )


def _training(cfg: dict) -> str:
    """The job's parallelism (ddp before it was a config group), with `+ lora` when it trained LoRA adapters."""
    name = (cfg.get("parallelism") or {}).get("name", "ddp")
    return f"{name} + lora" if (cfg.get("peft") or {}).get("name", "none") != "none" else name
