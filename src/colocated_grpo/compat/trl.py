"""What we know of TRL's internals (GRPOTrainer, its VLLMGeneration): the methods the phase hooks wrap, where the
colocated engine lives, the engine's seed (trl#7040), GRPOConfig's batch arithmetic and how TRL builds its
colocated engine. Nothing in TRL is changed; wrapped methods are called unchanged.

The phases (telemetry/phases.py names them):

    generate      GRPOTrainer._generate (vLLM or transformers generation; sync_weights nests inside)
    sync_weights  VLLMGeneration.sync_weights (colocate and server)
    sleep_wake    the colocated engine's sleep() and wake_up() (sleep mode only; inside generate and sync_weights)
    reward        GRPOTrainer._calculate_rewards
    train         GRPOTrainer.training_step (forward + backward) and the optimizer step (callback edges)
    other         the rest of TRL's _prepare_inputs (old/ref log-probs, advantages, gathering) and the loop
"""

from __future__ import annotations

import functools

# TRL's colocated engine: LLM(..., distributed_executor_backend="external_launcher", max_num_batched_tokens=4096,
# logprobs_mode="processed_logprobs") in trl/generation/vllm_generation.py; the generation benchmark mirrors it.
COLOCATE_ENGINE_KWARGS = {
    "distributed_executor_backend": "external_launcher",
    "max_num_batched_tokens": 4096,
    "logprobs_mode": "processed_logprobs",
}


def _wrap(obj, name: str, tracker, phase: str, after=None) -> None:
    original = getattr(obj, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        with tracker.phase(phase):
            result = original(*args, **kwargs)
        if after is not None:
            after(result)
        return result

    setattr(obj, name, wrapper)


def install_phase_hooks(trainer, tracker, tokens) -> None:
    """Time TRL's steps as phases of `tracker` (a telemetry PhaseTracker) and count the generated tokens into
    `tokens` (a telemetry TokenCounter)."""

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


def reseed_generation(trainer, seed: int) -> None:
    """Make the seed reach vLLM's sampling (trl#7040).

    TRL builds the colocated engine with seed = rank // tp, and vLLM's start-up reseeds torch's global RNG with
    it; its sampler then draws from that RNG, so every `seed` gave the same rollouts. Reseeding after the engine
    exists restores the dependence on `seed`. Ranks of one TP group must sample identically, so they share a seed;
    different data-parallel groups get different ones.
    """
    import numpy as np
    from transformers import set_seed

    args = trainer.args
    if not (args.use_vllm and args.vllm_mode == "colocate"):
        return
    dp_rank = trainer.accelerator.process_index // args.vllm_tensor_parallel_size
    set_seed(int(np.random.SeedSequence([seed, dp_rank]).generate_state(1)[0]))


def generation_batch_size(trainer: dict, world: int) -> int:
    """What TRL generates per optimiser round, mirroring GRPOConfig.__post_init__'s derivation from `trainer.*`."""
    if trainer.get("generation_batch_size"):
        return int(trainer["generation_batch_size"])
    steps = trainer.get("steps_per_generation") or trainer.get("gradient_accumulation_steps", 1)
    return int(trainer.get("per_device_train_batch_size", 8)) * world * int(steps)
