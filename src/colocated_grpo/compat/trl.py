"""What we know of TRL's internals (GRPOTrainer, its VLLMGeneration): the methods the phase hooks wrap (the phases:
docs/telemetry.md), where the colocated engine lives, the engine's seed (trl#7040), GRPOConfig's batch arithmetic
and how TRL builds its colocated engine. Wrapped methods are called unchanged."""

from __future__ import annotations

import functools
import math

# TRL's colocated engine: LLM(..., distributed_executor_backend="external_launcher", max_num_batched_tokens=4096,
# logprobs_mode="processed_logprobs") in trl/generation/vllm_generation.py; the generation benchmark mirrors it.
COLOCATE_ENGINE_KWARGS = {
    "distributed_executor_backend": "external_launcher",
    "max_num_batched_tokens": 4096,
    "logprobs_mode": "processed_logprobs",
}


def build_colocated_engines_with(**extra) -> None:
    """TRL builds its colocated engine (`LLM(...)` in trl/generation/vllm_generation.py) with these arguments too."""
    import trl.generation.vllm_generation as vllm_generation

    build = getattr(vllm_generation.LLM, "trl_original", vllm_generation.LLM)

    def LLM(*args, **kwargs):  # stands in for the class TRL calls
        return build(*args, **{**kwargs, **extra})

    LLM.trl_original = build
    vllm_generation.LLM = LLM


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
    """Time TRL's steps as phases of `tracker` and count generated tokens into `tokens` (telemetry.phases)."""

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
    if (generation := getattr(trainer, "vllm_generation", None)) is not None:
        _wrap(generation, "sync_weights", tracker, "sync_weights")
        llm = getattr(generation, "llm", None)  # the in-process engine: colocate only
        if llm is not None and getattr(generation, "enable_sleep_mode", False):
            _wrap(llm, "sleep", tracker, "sleep_wake")
            _wrap(llm, "wake_up", tracker, "sleep_wake")


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


def reseed_generation(trainer, seed: int) -> None:
    """Make the seed reach vLLM's sampling (trl#7040): TRL seeds the colocated engine with rank // tp, which reseeds
    torch's global RNG, so every `seed` gave the same rollouts. Reseeded here after the engine exists, one seed per
    data-parallel group (the ranks of one TP group must sample identically)."""
    import numpy as np
    from transformers import set_seed

    args = trainer.args
    if not (args.use_vllm and args.vllm_mode == "colocate"):
        return
    dp_rank = trainer.accelerator.process_index // args.vllm_tensor_parallel_size
    set_seed(int(np.random.SeedSequence([seed, dp_rank]).generate_state(1)[0]))


def generation_batch_size(trainer: dict, world: int) -> int:
    """What TRL generates per optimiser round on `world` processes: GRPOConfig.__post_init__'s arithmetic on
    `trainer.*`, for a world other than this process's (sweep jobs checked before their torchrun, finished runs)."""
    if trainer.get("generation_batch_size"):
        return int(trainer["generation_batch_size"])
    steps = trainer.get("steps_per_generation") or trainer.get("gradient_accumulation_steps", 1)
    return int(trainer.get("per_device_train_batch_size", 8)) * world * int(steps)


def extract_logprobs(outputs):
    """TRL's own parser of the colocated engine's outputs into per-token log-probs and token ids."""
    return _trl_parser()(outputs)


def _trl_parser():
    import trl.generation.vllm_generation as vllm_generation

    parse = vllm_generation.extract_logprobs
    return getattr(parse, "trl_original", parse)


def read_flat_logprobs(outputs):
    """extract_logprobs' result, read straight from vLLM's FlatLogprobs where each position holds one entry (TRL's
    logprobs=0 with flat_logprobs=True), without rebuilding per-token dicts; anything else goes to TRL's parser."""
    try:
        from vllm.logprobs import FlatLogprobs
    except ImportError:  # a vLLM before flat log-probs
        return _trl_parser()(outputs)

    all_logprobs, all_token_ids = [], []
    for request in outputs:
        for output in request.outputs:
            lp = output.logprobs
            if lp is None:
                return None, None
            if (
                not isinstance(lp, FlatLogprobs)
                or lp.start_indices != list(range(len(lp.start_indices)))
                or len(lp.logprobs) != len(lp.start_indices)
            ):
                return _trl_parser()(outputs)
            all_logprobs.append([[None if math.isnan(x) else x] for x in lp.logprobs])
            all_token_ids.append([[t] for t in lp.token_ids])
    return all_logprobs, all_token_ids


def install_flat_logprob_reader() -> None:
    """TRL's colocated generation parses the engine's outputs with read_flat_logprobs (for every trainer here)."""
    import trl.generation.vllm_generation as vllm_generation

    if getattr(vllm_generation.extract_logprobs, "trl_original", None) is None:
        read_flat_logprobs.trl_original = vllm_generation.extract_logprobs
        vllm_generation.extract_logprobs = read_flat_logprobs


# ----------------------------------------------------------------------------------------- colocated weight sync
#
# TRL's VLLMGeneration.sync_weights calls the engine model's `load_weights([(name, tensor)])` once per tensor, and
# each call walks every module of the model: tensors × modules of Python work per sync. The same tensors in one call
# (or a few, where FSDP2 gathers them) land the same weights in a fraction of the time.


def _engine_model(generation):
    """The in-process vLLM model, reached the way TRL reaches it."""
    return generation.llm.llm_engine.model_executor.driver_worker.model_runner.model


def fast_sync_plan(generation) -> str | None:
    """How the colocated weight sync can be batched: "one_call" (DDP, one process), "chunked" (FSDP2: full tensors
    gathered one by one, loaded in chunks), or None to keep TRL's own sync: server mode, ZeRO-3 and FSDP1 (views valid
    only inside a gather) and PEFT (adapters unmerged before a batched call would read the merged weights)."""
    from accelerate.utils import is_peft_model

    if getattr(generation, "mode", None) != "colocate" or not hasattr(generation, "_iter_named_params"):
        return None
    dist = getattr(generation, "_dist", None)
    if dist is None or dist.is_zero3 or dist.fsdp_version == 1 or is_peft_model(generation.model):
        return None
    return "chunked" if dist.fsdp_version == 2 else "one_call"


def _batched_sync(generation, chunk_bytes: int | None) -> None:
    """TRL's sync with batched load_weights calls: one call when chunk_bytes is None, else one per chunk."""
    from trl.generation.vllm_generation import empty_cache

    if generation.enable_sleep_mode:  # as TRL: map the weights back in before writing into them
        empty_cache()
        generation.llm.wake_up(tags=["weights"])
        generation._llm_weights_sleeping = False
    load = _engine_model(generation).load_weights
    pending, size = [], 0
    # TRL's own iterator: its name fixes, and FSDP2's full_tensor() gathers (collectives: every rank iterates).
    for name, tensor in generation._iter_named_params():
        pending.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        if chunk_bytes is not None and size >= chunk_bytes:
            load(pending)
            pending, size = [], 0
    if pending:
        load(pending)
    del pending  # FSDP2's gathered copies go before generation
    generation.llm.reset_prefix_cache()  # as TRL: cached KV was computed with the old weights


def install_fast_sync(trainer, chunk_bytes: int) -> str | None:
    """Batch this trainer's colocated weight sync (see fast_sync_plan); returns the plan, or None where TRL's own
    sync is kept. Install it before the phase hooks, which then time it as sync_weights."""
    generation = getattr(trainer, "vllm_generation", None)
    how = fast_sync_plan(generation) if generation is not None else None
    if how is None:
        return None
    chunk = chunk_bytes if how == "chunked" else None
    # An instance attribute shadows the class's method for every caller: GRPOTrainer's sync before generation and
    # VLLMGeneration.generate's re-sync of weights still asleep.
    generation.sync_weights = functools.partial(_batched_sync, generation, chunk)
    return how
