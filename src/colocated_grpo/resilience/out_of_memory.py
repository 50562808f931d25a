"""Out of memory, said in our config keys. A GPU that runs out once training has started: `explain` turns torch's
message into one line that says where the step was (training, generating, pushing weights), the numbers torch saw, and
which settings of ours free memory for that side, leaving out those already chosen. vLLM running out while it starts:
`explain_startup_error` turns vLLM's message into one that names `trainer.vllm_gpu_memory_utilization`,
`trainer.vllm_max_model_length` or `run.cpu_kvcache_gb` with the numbers vLLM saw and a value that fits."""

from __future__ import annotations

import math
import os
import re
import traceback

from colocated_grpo.compat import vllm as vllm_internals

SIZE = r"([\d.]+) (B|KiB|MiB|GiB|TiB)"
TRIED = re.compile(rf"Tried to allocate {SIZE}")
CAPACITY = re.compile(rf"total capacity of {SIZE} of which {SIZE} is free")
THIS_PROCESS = re.compile(rf"this process has {SIZE} memory in use")
BY_TORCH = re.compile(rf"{SIZE} is allocated by PyTorch")
UNITS = {"B": 2**-30, "KiB": 2**-20, "MiB": 2**-10, "GiB": 1.0, "TiB": 2**10}


class TrainingMemoryError(RuntimeError):
    """Out of GPU memory during training; the message names the settings that leave more room."""


def explain(exc: BaseException, cfg, step: int | None, checkpointing: bool | None = None) -> TrainingMemoryError | None:
    """A TrainingMemoryError for a CUDA out-of-memory error anywhere in `exc`'s chain; None for any other error.
    `step` is the step it happened in (None before the first); `checkpointing`, the gradient checkpointing in force
    (the trainer's, which run.auto_memory may have chosen; None: unknown). The caller raises it `from exc`."""
    oom = vllm_internals.first_matching(exc, (vllm_internals.CUDA_OOM,))
    if oom is None:
        return None
    where, engine_side = _where(oom)
    at = f" in step {step}" if step else ""
    if checkpointing is None and "gradient_checkpointing" in cfg.trainer:
        checkpointing = bool(cfg.trainer.gradient_checkpointing)
    return TrainingMemoryError(
        f"out of GPU memory {where}{at}{_numbers(str(oom))}. {_settings(cfg, checkpointing)}; to leave more room "
        f"{'for vLLM' if engine_side else 'for training'}: {'; '.join(_remedies(cfg, engine_side, checkpointing))}."
    )


def _where(oom: BaseException) -> tuple[str, bool]:
    """Which part of the step ran out, from the frames it was raised in; True when it was vLLM's side."""
    frames = traceback.extract_tb(oom.__traceback__)
    if any(f.name == "_move_model_to_vllm" for f in frames):
        return "while pushing the policy's weights into vLLM", True
    if any("/vllm/" in f.filename.replace("\\", "/") for f in frames):
        return "while vLLM generated (or woke from sleep)", True
    return "while training", False


def _numbers(message: str) -> str:
    """What torch saw, in GiB: the allocation asked for, the GPU's free and total memory, this process's share."""
    parts = []
    if m := TRIED.search(message):
        parts.append(f"it asked for {_gib(*m.groups())} GiB more")
    if m := CAPACITY.search(message):
        parts.append(f"{_gib(*m.groups()[2:])} GiB of the GPU's {_gib(*m.groups()[:2])} GiB were free")
    if m := THIS_PROCESS.search(message):
        held = f"this process held {_gib(*m.groups())} GiB"
        if t := BY_TORCH.search(message):
            held += f" ({_gib(*t.groups())} GiB of it through PyTorch's allocator)"
        parts.append(held)
    return ": " + ", ".join(parts) if parts else ""


def _gib(value: str, unit: str) -> str:
    return f"{float(value) * UNITS[unit]:.2f}"


def _settings(cfg, checkpointing: bool | None) -> str:
    t = cfg.trainer
    shared = f", vLLM's share trainer.vllm_gpu_memory_utilization={t.get('vllm_gpu_memory_utilization')}"
    placement = cfg.placement.name + (shared if cfg.placement.name.startswith("colocate") else "")
    return (
        f"It ran with model={cfg.model.get('build') or cfg.model.name_or_path}, parallelism={cfg.parallelism.name}, "
        f"peft={cfg.peft.name}, placement={placement}, trainer.per_device_train_batch_size="
        f"{t.per_device_train_batch_size}, {_checkpointing(cfg, checkpointing)}"
    )


def _checkpointing(cfg, checkpointing: bool | None) -> str:
    """The gradient checkpointing in force, and what decided it."""
    if checkpointing is None:
        return "trainer.gradient_checkpointing as run.auto_memory chose (the start lines say)"
    if "gradient_checkpointing" in cfg.trainer:
        by = "given"
    else:
        by = "chosen by run.auto_memory" if cfg.run.get("auto_memory") else "TRL's default"
    return f"gradient checkpointing {'on' if checkpointing else 'off'} ({by})"


def _remedies(cfg, engine_side: bool, checkpointing: bool | None = None) -> list[str]:
    """The settings that free memory for the side that ran out, leaving out those the run already has; first, where
    it was off, gradient checkpointing, which a resume of this run accepts."""
    t, placement = cfg.trainer, cfg.placement.name
    if engine_side:  # vLLM's reservation is full or its transient tensors found no room beside the policy
        return [
            f"trainer.vllm_gpu_memory_utilization lower than {t.get('vllm_gpu_memory_utilization')} (room for "
            "vLLM's transient tensors), or a smaller training state (parallelism=zero3_offload, peft=lora)",
            f"trainer.vllm_max_model_length lower (now {t.get('vllm_max_model_length')})",
            "more GPUs (trainer.vllm_tensor_parallel_size splits the engine)",
        ]
    found = []
    if checkpointing is False:  # the same gradients, so the run resumes with it from its last checkpoint
        found.append("trainer.gradient_checkpointing=true (a resume of this run accepts it)")
    sharded = cfg.parallelism.name in ("fsdp", "zero3", "zero3_offload")
    one_rank = int(os.environ.get("WORLD_SIZE", 1)) == 1  # measured: 7B fits one H200 with ddp, not fsdp or zero3
    if one_rank and cfg.parallelism.name in ("fsdp", "zero3"):
        found.append(
            "parallelism=ddp (one rank shards nothing, and ddp keeps no fp32 master copy of the bf16 weights: 8 "
            "bytes per parameter with AdamW instead of 16)"
        )
    if placement == "colocate":
        found.append("placement=colocate_sleep (vLLM hands its memory to training while it trains)")
    if cfg.parallelism.name != "zero3_offload":
        found.append("parallelism=zero3_offload (the optimizer state in CPU memory)")
    if cfg.peft.name == "none":
        found.append("peft=lora (only adapters train: no gradients or optimizer state for the base weights)")
    if checkpointing is None:  # unknown: the start line says whether it was on
        found.append("trainer.gradient_checkpointing=true, where it was off")
    if placement == "colocate":
        found.append(f"trainer.vllm_gpu_memory_utilization lower than {t.get('vllm_gpu_memory_utilization')}")
    if int(t.per_device_train_batch_size) > 1:
        found.append(
            f"trainer.per_device_train_batch_size below {t.per_device_train_batch_size}, with "
            "gradient_accumulation_steps and steps_per_generation raised to keep the completions per step"
        )
    found.append(f"more GPUs ({'it shards' if sharded else 'parallelism=fsdp or zero3 shard'} the policy over them)")
    return found


class StartupMemoryError(RuntimeError):
    """vLLM could not get the memory it needs while starting; the message names the config keys to change."""


def explain_startup_error(exc: BaseException, cfg) -> StartupMemoryError | None:
    """A StartupMemoryError for a memory failure of vLLM's start-up (or of loading the policy beside it); None for
    any other error. The caller raises it `from exc`, so the original traceback stays visible."""
    text = vllm_internals.memory_failure(exc)
    if text is None:
        return None
    util_key = f"trainer.vllm_gpu_memory_utilization={cfg.trainer.get('vllm_gpu_memory_utilization')}"
    max_len = cfg.trainer.get("vllm_max_model_length")
    kv_gb = os.environ.get("VLLM_CPU_KVCACHE_SPACE") or f"{cfg.run.cpu_kvcache_gb:g}"

    if m := vllm_internals.GPU_FREE.search(text):
        free, total, want, want_gb = (float(x) for x in m.groups())
        fits = max(0.01, math.floor((free / total - 0.02) * 100) / 100)  # with 0.02 of room, floored to 0.01
        message = (
            f"vLLM could not start: {util_key} asks for {want} x {total} GiB = {want_gb} GiB of each GPU, but only "
            f"{free} GiB of {total} GiB were free when the engine started. In colocate mode the policy is loaded "
            "on the same GPU first and keeps its memory. Set trainer.vllm_gpu_memory_utilization to at most "
            f"{fits}, free the GPU of other processes, or shard the policy (parallelism=fsdp / zero3)."
        )
    elif m := vllm_internals.CPU_KV.search(text):
        node, free, total, want_gb = m.groups()
        message = (
            f"vLLM could not allocate its CPU KV cache: run.cpu_kvcache_gb={kv_gb} (VLLM_CPU_KVCACHE_SPACE) asks for "
            f"{want_gb} GiB, but NUMA node {node} has {free} GiB of {total} GiB available. On CPU this, not "
            f"{util_key}, sizes the KV cache: set run.cpu_kvcache_gb to at most {max(1, int(float(free)) - 1)}."
        )
    elif m := vllm_internals.CPU_FREE.search(text):
        node, free, total, want, want_gb = m.groups()
        message = (
            f"vLLM could not start on CPU: {util_key} asks for {want} x {total} GiB = {want_gb} GiB of memory, but "
            f"NUMA node {node} has {free} GiB available. Set run.cpu_kvcache_gb (VLLM_CPU_KVCACHE_SPACE) to size "
            "the KV cache explicitly, or lower trainer.vllm_gpu_memory_utilization."
        )
    elif m := vllm_internals.KV_TOO_SMALL.search(text):
        import torch

        length, need, have, estimate = m.groups()
        budget = util_key if torch.cuda.is_available() else f"run.cpu_kvcache_gb={kv_gb}"
        fit = f"at most {estimate} (vLLM's estimate for this memory)" if estimate else "lower"
        message = (
            f"vLLM's KV cache cannot hold one sequence of trainer.vllm_max_model_length={max_len or length}: it needs "
            f"{need} GiB, but {budget} leaves {have} GiB for the KV cache. Set trainer.vllm_max_model_length {fit}, "
            f"raise {budget.split('=')[0]}, or spread the model over more GPUs (trainer.vllm_tensor_parallel_size)."
        )
    elif vllm_internals.NO_CACHE.search(text):
        message = (
            f"vLLM has no memory left for its KV cache: {util_key} is the share of each GPU vLLM may use, and the "
            "model weights and activation peak already take all of it. Raise trainer.vllm_gpu_memory_utilization "
            f"(the policy in training needs the rest), lower trainer.vllm_max_model_length={max_len}, or use more "
            "tensor parallelism (trainer.vllm_tensor_parallel_size)."
        )
    else:
        message = (
            f"out of GPU memory while starting (loading the policy and the colocated vLLM engine): vLLM takes "
            f"{util_key} of each GPU and the policy needs the rest. Lower trainer.vllm_gpu_memory_utilization, "
            "use a smaller model, or shard the policy (parallelism=fsdp / zero3)."
        )
    return StartupMemoryError(f"{message}\nOriginal error: {text}")
