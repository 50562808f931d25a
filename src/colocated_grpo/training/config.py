"""Config checks that run before any model is loaded or GPU memory is taken, and the mapping to GRPOConfig."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from colocated_grpo.compat.trl import generation_batch_size
from colocated_grpo.resilience.checkpoints import RESUME_MODES
from colocated_grpo.training import rewards
from colocated_grpo.training.models import SHAPES, attention_heads

# Our keys that are not GRPOConfig fields; everything under `trainer` goes to GRPOConfig unchanged.
RUNNER_OWNED = ("output_dir", "report_to", "seed", "reward_weights", "run_name")


class ConfigError(ValueError):
    """One or more invalid settings; the message names each key and how to fix it."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def world_size(cfg: DictConfig) -> int:
    """Processes in this job: torchrun's WORLD_SIZE when launched, else what the sweep launcher will start."""
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return int(OmegaConf.select(cfg, "parallelism.nproc_per_node", default=1))


def validate(cfg: DictConfig, world: int | None = None) -> None:
    """Raise ConfigError listing every problem found; silent when the config can run."""
    world = world_size(cfg) if world is None else world
    trainer = cfg.trainer
    problems: list[str] = []

    problems += _unknown_trainer_keys(trainer)

    if trainer.get("use_vllm"):
        mem = trainer.get("vllm_gpu_memory_utilization", 0.3)
        if not 0 < float(mem) < 1:
            problems.append(
                f"trainer.vllm_gpu_memory_utilization={mem} must be strictly between 0 and 1 "
                "(the share of each GPU vLLM may take, e.g. 0.3)"
            )
        if trainer.get("vllm_mode", "colocate") == "colocate":
            tp = int(trainer.get("vllm_tensor_parallel_size", 1))
            if tp < 1 or world % tp:
                problems.append(
                    f"trainer.vllm_tensor_parallel_size={tp} must divide the world size {world} "
                    f"(torchrun --nproc_per_node / parallelism.nproc_per_node); use one of {_divisors(world)}"
                )
            problems += _heads_problems(cfg.model, tp, "trainer.vllm_tensor_parallel_size")
        elif trainer.get("vllm_mode") == "server":
            p = cfg.placement
            if not 0 < float(p.gpu_memory_utilization) < 1:
                problems.append(
                    f"placement.gpu_memory_utilization={p.gpu_memory_utilization} must be strictly between 0 and 1"
                )
            problems += _heads_problems(
                cfg.model, int(p.server_tensor_parallel_size), "placement.server_tensor_parallel_size"
            )

    num_gen = int(trainer.get("num_generations", 8))
    batch = generation_batch_size(trainer, world)
    if num_gen < 2:
        problems.append(f"trainer.num_generations={num_gen} must be at least 2 (GRPO compares completions of a prompt)")
    elif batch % num_gen:
        problems.append(
            f"trainer.num_generations={num_gen} must divide the generation batch {batch} "
            f"(per_device_train_batch_size × world size {world} × steps_per_generation); "
            f"use one of {[d for d in _divisors(batch) if d >= 2]} or change the batch"
        )

    for module in OmegaConf.select(cfg, "reward.modules") or []:
        try:
            rewards.load_modules([module])
        except Exception as exc:
            problems.append(
                f"reward.modules: cannot import {module!r} ({type(exc).__name__}: {exc}); "
                "its directory must be on PYTHONPATH"
            )
    weights = OmegaConf.select(cfg, "reward.weights") or {}
    if not weights:
        problems.append(f"reward.weights is empty; name at least one of {sorted(rewards.REGISTRY)}")
    for name in weights:
        if name not in rewards.REGISTRY:
            problems.append(f"reward.weights.{name}: unknown reward '{name}'; registered: {sorted(rewards.REGISTRY)}")

    max_steps = trainer.get("max_steps", -1)
    if not isinstance(max_steps, int) or (max_steps < 1 and max_steps != -1):
        problems.append(
            f"trainer.max_steps={max_steps} must be a positive number of steps, or -1 to train "
            "trainer.num_train_epochs over the dataset"
        )
    problems += _model_problems(cfg.model)
    problems += _run_problems(cfg)
    if cfg.placement.get("fast_sync") and not float(cfg.placement.sync_chunk_gb) > 0:
        problems.append(
            f"placement.sync_chunk_gb={cfg.placement.sync_chunk_gb} must be above 0 (GiB of gathered FSDP2 weights "
            "loaded into vLLM at once, e.g. 1.0)"
        )

    if OmegaConf.select(cfg, "telemetry.enabled") and int(trainer.get("logging_steps", 500)) != 1:
        problems.append(
            f"trainer.logging_steps={trainer.get('logging_steps')}: telemetry records every step, so it must be 1 "
            "(or turn telemetry off with telemetry=off)"
        )

    if cfg.parallelism.name == "zero3" and importlib.util.find_spec("deepspeed") is None:
        problems.append("parallelism=zero3 needs the `deepspeed` package: pip install deepspeed (or use ddp / fsdp)")

    if problems:
        raise ConfigError(problems)


def gpu_only_problems(cfg: DictConfig) -> list[str]:
    """What this config needs a GPU for; checked where the job runs (or, for a sweep, on the machine it runs on)."""
    problems = []
    trainer = cfg.trainer
    if trainer.get("use_vllm") and trainer.get("vllm_enable_sleep_mode"):
        problems.append(
            "trainer.vllm_enable_sleep_mode=true (vllm=colocate_sleep) needs a GPU; vLLM on CPU has no sleep mode"
        )
    if cfg.parallelism.name == "fsdp":
        problems.append(
            "parallelism=fsdp needs GPUs: accelerate turns FSDP on only for GPU-like devices, so on CPU it would "
            "train plain DDP under an FSDP name; use parallelism=ddp here"
        )
    return problems


def _run_problems(cfg: DictConfig) -> list[str]:
    problems = []
    resume = cfg.run.resume
    if resume not in RESUME_MODES:
        problems.append(f"run.resume={resume!r} must be one of {list(RESUME_MODES)}")
    for key in ("stop_on_nonfinite", "fixed_completion_length"):
        if not isinstance(cfg.run[key], bool):
            problems.append(f"run.{key} must be true or false")
    return problems


def _unknown_trainer_keys(trainer: DictConfig) -> list[str]:
    from trl import GRPOConfig

    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    problems = []
    for key in trainer:
        if key not in fields:
            problems.append(f"trainer.{key} is not a trl.GRPOConfig field (keys under trainer/ are TRL's own names)")
        elif key in RUNNER_OWNED:
            problems.append(f"trainer.{key} is set by the runner; remove it (see run.* / logger.* / seed)")
    return problems


def _model_problems(model: DictConfig) -> list[str]:
    if model.get("build"):
        if model.build not in SHAPES:
            return [f"model.build={model.build!r} is not a known shape; choose one of {sorted(SHAPES)}"]
        return []
    path = str(model.name_or_path)
    # Hub ids are "org/name"; anything else with a slash, or starting like a path, is a local directory.
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") > 1 or Path(path).exists()
    if looks_local and not (Path(path).expanduser() / "config.json").exists():
        return [
            f"model.name_or_path={path!r}: no model directory there (config.json missing); "
            "give an existing directory, a hub id like Qwen/Qwen2.5-1.5B-Instruct, or a model with `build:`"
        ]
    return []


def _heads_problems(model: DictConfig, tp: int, key: str) -> list[str]:
    if tp < 1 or _model_problems(model):
        return []  # reported elsewhere
    try:
        heads, kv_heads = attention_heads(model)
    except Exception as exc:  # an unreachable hub id: say so instead of failing later inside vLLM
        return [f"model.name_or_path={model.name_or_path!r}: cannot read its config ({type(exc).__name__}: {exc})"]
    problems = []
    for what, n in (("attention heads", heads), ("KV heads", kv_heads)):
        if n % tp:
            problems.append(
                f"{key}={tp} must divide the model's {n} {what} ({model.name_or_path}); use one of {_divisors(n)}"
            )
    return problems


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def grpo_config(cfg: DictConfig, output_dir: str, report_to: list[str]):
    """trl.GRPOConfig from `trainer.*` plus what the runner owns (output dir, reporting, seed, reward weights)."""
    import torch
    from trl import GRPOConfig

    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    if not torch.cuda.is_available():
        # Without it, transformers ignores torchrun on CPU and every rank trains alone (world size 1).
        kwargs.setdefault("use_cpu", True)
    kwargs.setdefault("model_init_kwargs", {}).setdefault("dtype", cfg.model.get("dtype", "auto"))
    # Our generation settings go under the user's own trainer.generation_kwargs, which win.
    ours = {}
    if cfg.run.fixed_completion_length:
        ours.update(fixed_length_kwargs(kwargs))
    if kwargs.get("use_vllm") and kwargs.get("vllm_mode") == "colocate" and cfg.placement.get("fast_outputs"):
        from colocated_grpo.compat.vllm import fast_output_kwargs

        ours.update(fast_output_kwargs())
    if ours:
        kwargs["generation_kwargs"] = {**ours, **(kwargs.get("generation_kwargs") or {})}
    return GRPOConfig(
        output_dir=output_dir,
        report_to=report_to,
        run_name=cfg.run.name,
        seed=int(cfg.seed),
        reward_weights=[float(w) for w in cfg.reward.weights.values()],
        **kwargs,
    )


def fixed_length_kwargs(trainer: dict) -> dict:
    """Generation kwargs that make every completion exactly max_completion_length tokens (EOS suppressed until then),
    so benchmark steps do equal work whichever backend generates: vLLM's SamplingParams or transformers' generate."""
    length = int(trainer.get("max_completion_length", 256))
    if trainer.get("use_vllm"):
        return {"min_tokens": length, "ignore_eos": True}
    return {"min_new_tokens": length}
