"""vLLM running out of memory while it starts: `explain_startup_error` turns vLLM's message into one that names our
config keys (`trainer.vllm_gpu_memory_utilization`, `trainer.vllm_max_model_length`, `run.cpu_kvcache_gb`) with the
numbers vLLM saw and a value that fits."""

from __future__ import annotations

import math
import os

from colocated_grpo.compat.vllm import CPU_FREE, CPU_KV, GPU_FREE, KV_TOO_SMALL, NO_CACHE, memory_failure


class StartupMemoryError(RuntimeError):
    """vLLM could not get the memory it needs while starting; the message names the config keys to change."""


def explain_startup_error(exc: BaseException, cfg) -> StartupMemoryError | None:
    """A StartupMemoryError for a memory failure of vLLM's start-up (or of loading the policy beside it); None for
    any other error. The caller raises it `from exc`, so the original traceback stays visible."""
    text = memory_failure(exc)
    if text is None:
        return None
    util_key = f"trainer.vllm_gpu_memory_utilization={cfg.trainer.get('vllm_gpu_memory_utilization')}"
    max_len = cfg.trainer.get("vllm_max_model_length")
    kv_gb = os.environ.get("VLLM_CPU_KVCACHE_SPACE", cfg.run.get("cpu_kvcache_gb"))

    if m := GPU_FREE.search(text):
        free, total, want, want_gb = (float(x) for x in m.groups())
        fits = max(0.01, math.floor((free / total - 0.02) * 100) / 100)  # with 0.02 of room, floored to 0.01
        message = (
            f"vLLM could not start: {util_key} asks for {want} x {total} GiB = {want_gb} GiB of each GPU, but only "
            f"{free} GiB of {total} GiB were free when the engine started. In colocate mode the policy is loaded "
            "on the same GPU first and keeps its memory. Set trainer.vllm_gpu_memory_utilization to at most "
            f"{fits}, free the GPU of other processes, or shard the policy (parallelism=fsdp / zero3)."
        )
    elif m := CPU_KV.search(text):
        node, free, total, want_gb = m.groups()
        message = (
            f"vLLM could not allocate its CPU KV cache: run.cpu_kvcache_gb={kv_gb} (VLLM_CPU_KVCACHE_SPACE) asks for "
            f"{want_gb} GiB, but NUMA node {node} has {free} GiB of {total} GiB available. On CPU this, not "
            f"{util_key}, sizes the KV cache: set run.cpu_kvcache_gb to at most {max(1, int(float(free)) - 1)}."
        )
    elif m := CPU_FREE.search(text):
        node, free, total, want, want_gb = m.groups()
        message = (
            f"vLLM could not start on CPU: {util_key} asks for {want} x {total} GiB = {want_gb} GiB of memory, but "
            f"NUMA node {node} has {free} GiB available. Set run.cpu_kvcache_gb (VLLM_CPU_KVCACHE_SPACE) to size "
            "the KV cache explicitly, or lower trainer.vllm_gpu_memory_utilization."
        )
    elif m := KV_TOO_SMALL.search(text):
        import torch

        length, need, have, estimate = m.groups()
        budget = util_key if torch.cuda.is_available() else f"run.cpu_kvcache_gb={kv_gb}"
        fit = f"at most {estimate} (vLLM's estimate for this memory)" if estimate else "lower"
        message = (
            f"vLLM's KV cache cannot hold one sequence of trainer.vllm_max_model_length={max_len or length}: it needs "
            f"{need} GiB, but {budget} leaves {have} GiB for the KV cache. Set trainer.vllm_max_model_length {fit}, "
            f"raise {budget.split('=')[0]}, or spread the model over more GPUs (trainer.vllm_tensor_parallel_size)."
        )
    elif NO_CACHE.search(text):
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
