"""What we know of TRL's internals outside the trainer class (that is compat/grpo_trainer.py and our trainer, which
import TRL): where the colocated engine lives, GRPOConfig's batch arithmetic, how TRL builds its colocated engine, the
flat log-prob reader that stands in for TRL's parser, and the deprecated transformers names it still calls. Light to
import: no TRL at module level."""

from __future__ import annotations

import contextlib
import math
import warnings

# TRL's colocated engine: LLM(..., distributed_executor_backend="external_launcher", max_num_batched_tokens=4096,
# logprobs_mode="processed_logprobs") in trl/generation/vllm_generation.py; the generation benchmark mirrors it.
COLOCATE_ENGINE_KWARGS = {
    "distributed_executor_backend": "external_launcher",
    "max_num_batched_tokens": 4096,
    "logprobs_mode": "processed_logprobs",
}


# transformers 5 renamed gradient checkpointing "activation checkpointing"; TRL 1.16 still calls the old names (its
# GRPOConfig field, `is_gradient_checkpointing`, and `gradient_checkpointing_disable` / `_enable` around its no-grad
# forwards and its generation), a FutureWarning for each in every run that checkpoints.
DEPRECATED_CHECKPOINTING_NAMES = r"`(is_)?gradient_checkpointing(_enable|_disable)?` is deprecated"


def quiet_deprecated_checkpointing_names() -> None:
    """No FutureWarning for the deprecated names TRL calls (nothing a user of TRL can change)."""
    warnings.filterwarnings("ignore", message=DEPRECATED_CHECKPOINTING_NAMES, category=FutureWarning)


def build_colocated_engines_with(around=None, **extra) -> None:
    """TRL builds its colocated engine (`LLM(...)` in trl/generation/vllm_generation.py) with these arguments too, and
    inside `around()` where given (a context manager: the environment the engine's processes start in)."""
    import trl.generation.vllm_generation as vllm_generation

    build = getattr(vllm_generation.LLM, "trl_original", vllm_generation.LLM)

    def LLM(*args, **kwargs):  # stands in for the class TRL calls
        with around() if around is not None else contextlib.nullcontext():
            return build(*args, **{**kwargs, **extra})

    LLM.trl_original = build
    vllm_generation.LLM = LLM


def engine_config(trainer):
    """The colocated engine's VllmConfig; None without an in-process engine (server placement, no vLLM)."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    return getattr(getattr(llm, "llm_engine", None), "vllm_config", None)


def kv_cache_tokens(trainer) -> int | None:
    """Tokens the colocated engine's KV cache holds (blocks × block size); None without one or before it is sized."""
    cache = getattr(engine_config(trainer), "cache_config", None)
    if cache is None or not cache.num_gpu_blocks:
        return None
    return int(cache.num_gpu_blocks) * int(cache.block_size)


def generation_batch_size(trainer: dict, world: int) -> int:
    """What TRL generates per optimiser round on `world` processes: GRPOConfig.__post_init__'s arithmetic on
    `trainer.*`, for a world other than this process's (sweep jobs checked before their torchrun, finished runs)."""
    if trainer.get("generation_batch_size"):
        return int(trainer["generation_batch_size"])
    steps = trainer.get("steps_per_generation") or trainer.get("gradient_accumulation_steps", 1)
    return int(trainer.get("per_device_train_batch_size", 8)) * world * int(steps)


def extract_logprobs(outputs):
    """TRL's own parser of the colocated engine's outputs into per-token log-probs and token ids."""
    import trl.generation.vllm_generation as vllm_generation

    return vllm_generation.extract_logprobs(outputs)


def read_flat_logprobs(outputs, fallback=extract_logprobs):
    """extract_logprobs' result, read straight from vLLM's FlatLogprobs where each position holds one entry (TRL's
    logprobs=0 with flat_logprobs=True), without rebuilding per-token dicts; anything else goes to `fallback` (TRL's
    parser)."""
    try:
        from vllm.logprobs import FlatLogprobs
    except ImportError:  # a vLLM before flat log-probs
        return fallback(outputs)

    all_logprobs, all_token_ids = [], []
    for request in outputs:
        for output in request.outputs:
            lp = output.logprobs
            if lp is None:
                return None, None
            one_each = isinstance(lp, FlatLogprobs) and lp.start_indices == list(range(len(lp.start_indices)))
            if not one_each or len(lp.logprobs) != len(lp.start_indices):
                return fallback(outputs)
            all_logprobs.append([[None if math.isnan(x) else x] for x in lp.logprobs])
            all_token_ids.append([[t] for t in lp.token_ids])
    return all_logprobs, all_token_ids
