"""The only place that knows TRL's internals: thin wrappers on one GRPOTrainer instance that mark phases and
count tokens. Nothing in TRL is changed; the wrapped methods are called unchanged.

    generate      GRPOTrainer._generate (vLLM or transformers generation; sync_weights nests inside)
    sync_weights  VLLMGeneration.sync_weights (colocate and server)
    sleep_wake    the colocated engine's sleep() and wake_up() (sleep mode only; inside generate and sync_weights)
    reward        GRPOTrainer._calculate_rewards
    train         GRPOTrainer.training_step (forward + backward) and the optimizer step (callback edges)
    other         the rest of TRL's _prepare_inputs (old/ref log-probs, advantages, gathering) and the loop
"""

from __future__ import annotations

import functools

from colocated_grpo.telemetry.phases import PhaseTracker


class TokenCounter:
    def __init__(self):
        self.prompt = self.completion = 0

    def reset(self) -> tuple[int, int]:
        counts = (self.prompt, self.completion)
        self.prompt = self.completion = 0
        return counts


def _wrap(obj, name: str, tracker: PhaseTracker, phase: str, after=None) -> None:
    original = getattr(obj, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with tracker.phase(phase):
            result = original(*args, **kwargs)
        if after is not None:
            after(result)
        return result

    setattr(obj, name, wrapper)


def install(trainer, tracker: PhaseTracker, tokens: TokenCounter) -> None:
    def count(result):
        prompt_ids, completion_ids = result[0], result[1]
        tokens.prompt += sum(len(ids) for ids in prompt_ids)
        tokens.completion += sum(len(ids) for ids in completion_ids)

    _wrap(trainer, "training_step", tracker, "train")
    _wrap(trainer, "_prepare_inputs", tracker, "other")
    _wrap(trainer, "_generate", tracker, "generate", after=count)
    _wrap(trainer, "_calculate_rewards", tracker, "reward")
    if hasattr(trainer, "_clip_grad_norm"):
        _wrap(trainer, "_clip_grad_norm", tracker, "train")
    generation = getattr(trainer, "vllm_generation", None)
    if generation is not None:
        _wrap(generation, "sync_weights", tracker, "sync_weights")
        llm = getattr(generation, "llm", None)  # the in-process engine: colocate only
        if llm is not None and getattr(generation, "enable_sleep_mode", False):
            _wrap(llm, "sleep", tracker, "sleep_wake")
            _wrap(llm, "wake_up", tracker, "sleep_wake")


def kv_cache_tokens(trainer) -> int | None:
    """Tokens the colocated engine's KV cache holds (blocks × block size), what its memory share buys; None without
    an in-process engine (server placement, no vLLM) or before vLLM has sized its cache."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    cache = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
    if cache is None or not cache.num_gpu_blocks:
        return None
    return int(cache.num_gpu_blocks) * int(cache.block_size)
