"""Failures that stop a run with a message saying what went wrong, with the numbers seen, and what to change.

- vLLM running out of memory while it starts: `explain_startup_error` turns vLLM's message into one that names
  our config keys (`trainer.vllm_gpu_memory_utilization`, `trainer.vllm_max_model_length`, `run.cpu_kvcache_gb`)
  with the numbers vLLM saw and a value that fits.
- A non-finite loss, reward or gradient norm: `StopOnNonFinite` stops training at the step that logged it, before
  a checkpoint of the damaged weights is saved (`run.stop_on_nonfinite`; non-finite values of single rewards are
  caught earlier, naming function and sample, in `rewards.for_trl`).
"""

from __future__ import annotations

import math
import os
import re

from transformers import TrainerCallback

CHECKED = ("loss", "reward", "grad_norm")


class NonFiniteError(RuntimeError):
    pass


class StopOnNonFinite(TrainerCallback):
    """Raise NonFiniteError when a logged loss, reward or grad norm is NaN or infinite."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        bad = {k: logs[k] for k in CHECKED if k in (logs or {}) and not _finite(logs[k])}
        if args.fp16:  # the loss scaler skips steps with an infinite gradient norm; those are expected
            bad.pop("grad_norm", None)
        if not bad:
            return
        from colocated_grpo.checkpointing import latest

        last = latest(args.output_dir)
        values = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise NonFiniteError(
            f"non-finite {values} at step {state.global_step}: training stopped before these weights are saved. "
            f"Last checkpoint: {last.path if last else 'none'}. Usual causes: rewards too large for float32 "
            "(|r| > 3.4e38) or infinite, a learning rate that makes the policy diverge, fp16 overflow (use bf16). "
            "Set run.stop_on_nonfinite=false to train on regardless."
        )


def _finite(value) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return True  # not a number: nothing to check


class StartupMemoryError(RuntimeError):
    """vLLM could not get the memory it needs while starting; the message names the config keys to change."""


_NUM = r"([\d.]+)"
_GPU_FREE = re.compile(
    rf"Free memory on device\s*\S*\s*\({_NUM}/{_NUM} GiB\) on startup is less than desired GPU memory "
    rf"utilization \({_NUM}, {_NUM} GiB\)"
)
_CPU_FREE = re.compile(
    rf"Available memory on node (\d+) \({_NUM}/{_NUM} GiB\) on startup is less than desired CPU memory "
    rf"utilization \({_NUM}, {_NUM} GiB\)"
)
_CPU_KV = re.compile(
    rf"Available memory on node (\d+) \({_NUM}/{_NUM} GiB\) on kv cache allocation is less than requested "
    rf"memory for kv \({_NUM} GiB\)"
)
_NO_CACHE = re.compile(r"No available memory for the cache blocks|Cannot auto-fit max_model_len")
_KV_TOO_SMALL = re.compile(
    rf"max seq len \((\d+)\), \({_NUM} GiB KV cache is needed, which is larger than the available KV cache "
    rf"memory \({_NUM} GiB\)\.(?: Based on the available memory, the estimated maximum model length is (\d+)\.)?"
)
_CUDA_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError")
_MEMORY_ERRORS = (_GPU_FREE, _CPU_FREE, _CPU_KV, _NO_CACHE, _KV_TOO_SMALL, _CUDA_OOM)


def explain_startup_error(exc: BaseException, cfg) -> StartupMemoryError | None:
    """A StartupMemoryError for a memory failure of vLLM's start-up (or of loading the policy beside it); None for
    any other error. The caller raises it `from exc`, so the original traceback stays visible."""
    text = _memory_error_text(exc)
    if text is None:
        return None
    trainer = cfg.trainer
    util = trainer.get("vllm_gpu_memory_utilization")
    util_key = f"trainer.vllm_gpu_memory_utilization={util}"
    max_len = trainer.get("vllm_max_model_length")
    kv_gb = os.environ.get("VLLM_CPU_KVCACHE_SPACE", cfg.run.get("cpu_kvcache_gb"))

    if m := _GPU_FREE.search(text):
        free, total, want, want_gb = (float(x) for x in m.groups())
        message = (
            f"vLLM could not start: {util_key} asks for {want} x {total} GiB = {want_gb} GiB of each GPU, but only "
            f"{free} GiB of {total} GiB were free when the engine started. In colocate mode the policy is loaded "
            "on the same GPU first and keeps its memory. Set trainer.vllm_gpu_memory_utilization to at most "
            f"{_fraction_below(free / total)}, free the GPU of other processes, or shard the policy "
            "(parallelism=fsdp / zero3)."
        )
    elif m := _CPU_KV.search(text):
        node, free, total, want_gb = m.groups()
        message = (
            f"vLLM could not allocate its CPU KV cache: run.cpu_kvcache_gb={kv_gb} (VLLM_CPU_KVCACHE_SPACE) asks for "
            f"{want_gb} GiB, but NUMA node {node} has {free} GiB of {total} GiB available. On CPU this, not "
            f"{util_key}, sizes the KV cache: set run.cpu_kvcache_gb to at most {max(1, int(float(free)) - 1)}."
        )
    elif m := _CPU_FREE.search(text):
        node, free, total, want, want_gb = m.groups()
        message = (
            f"vLLM could not start on CPU: {util_key} asks for {want} x {total} GiB = {want_gb} GiB of memory, but "
            f"NUMA node {node} has {free} GiB available. Set run.cpu_kvcache_gb (VLLM_CPU_KVCACHE_SPACE) to size "
            "the KV cache explicitly, or lower trainer.vllm_gpu_memory_utilization."
        )
    elif m := _KV_TOO_SMALL.search(text):
        length, need, have, estimate = m.groups()
        budget = f"run.cpu_kvcache_gb={kv_gb}" if _on_cpu() else util_key
        fit = f"at most {estimate} (vLLM's estimate for this memory)" if estimate else "lower"
        message = (
            f"vLLM's KV cache cannot hold one sequence of trainer.vllm_max_model_length={max_len or length}: it needs "
            f"{need} GiB, but {budget} leaves {have} GiB for the KV cache. Set trainer.vllm_max_model_length {fit}, "
            f"raise {budget.split('=')[0]}, or spread the model over more GPUs (trainer.vllm_tensor_parallel_size)."
        )
    elif _NO_CACHE.search(text):
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


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _memory_error_text(exc: BaseException) -> str | None:
    """`Type: message` of the first exception in the chain that is a start-up memory failure."""
    for e in _chain(exc):
        text = f"{type(e).__name__}: {e}"
        if any(p.search(text) for p in _MEMORY_ERRORS):
            return text
    return None


def _fraction_below(share: float) -> float:
    """A utilisation that fits in `share` of the device with a little room left: floor to 0.01 after 0.02 margin."""
    return max(0.01, math.floor((share - 0.02) * 100) / 100)


def _on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()
