"""What we know of TRL's internals (GRPOTrainer, its VLLMGeneration): the methods the phase hooks wrap (the phases:
docs/telemetry.md), where the colocated engine lives, the engine's seed (trl#7040), GRPOConfig's batch arithmetic,
how TRL builds its colocated engine, and the three places where our code stands in for TRL's (the log-prob reader,
the batched weight sync, the importance-sampling ratio from the training forward), each checked against the TRL
source it was written for. Wrapped methods are called unchanged."""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import logging
import math

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------ the upstream guard
#
# Each replacement of TRL code names the TRL functions whose behaviour it assumes, with a digest of their source as
# written for trl 1.16.0. Another TRL whose sources differ runs its own code, and one line says why; a release with
# the same sources keeps the replacement (the source is what the replacement depends on, not the version number).
WRITTEN_FOR_VERSION = "1.16.0"
WRITTEN_FOR = {
    "flat log-prob reader": {
        "trl.generation.vllm_generation:extract_logprobs": "ea9254b4a72d",
    },
    "batched weight sync": {
        "trl.generation.vllm_generation:VLLMGeneration.sync_weights": "63d669fb3230",
        "trl.generation.vllm_generation:VLLMGeneration._iter_named_params": "baab615d5c7b",
    },
    "importance-sampling ratio from the training forward": {
        "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions": "1fa48922792d",
        "trl.trainer.grpo_trainer:GRPOTrainer._compute_loss": "80295546bbdb",
        "trl.trainer.grpo_trainer:GRPOTrainer._prepare_inputs": "f824e7fb0714",
    },
}


def source_digest(target: str) -> str | None:
    """The first 12 hex digits of the sha256 of `module:Qualified.name`'s source; None where it does not exist."""
    module_name, _, qualname = target.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        obj = getattr(obj, "trl_original", obj)  # ours installed earlier: the digest is of TRL's own
        source = inspect.getsource(obj)
    except (ImportError, AttributeError, OSError, TypeError):
        return None
    return hashlib.sha256(source.encode()).hexdigest()[:12]


def upstream_mismatch(replacement: str) -> str | None:
    """None when every TRL function `replacement` stands in for has the source it was written for; else one line
    saying that TRL's own code runs, and why."""
    import trl

    changed = [target for target, digest in WRITTEN_FOR[replacement].items() if source_digest(target) != digest]
    if not changed:
        return None
    names = ", ".join(target.partition(":")[2] for target in changed)
    return (
        f"{replacement}: TRL's own code runs: written for trl {WRITTEN_FOR_VERSION}, this is trl {trl.__version__} "
        f"and {names} changed"
    )


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


def install_flat_logprob_reader() -> str | None:
    """TRL's colocated generation parses the engine's outputs with read_flat_logprobs (for every trainer here);
    returns why not where TRL's parser is not the one it was written for."""
    import trl.generation.vllm_generation as vllm_generation

    if why_not := upstream_mismatch("flat log-prob reader"):
        return why_not
    if getattr(vllm_generation.extract_logprobs, "trl_original", None) is None:
        read_flat_logprobs.trl_original = vllm_generation.extract_logprobs
        vllm_generation.extract_logprobs = read_flat_logprobs
    return None


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


def install_fast_sync(trainer, chunk_bytes: int) -> str:
    """Batch this trainer's colocated weight sync (see fast_sync_plan) where it can be; returns one line saying
    which sync runs. Install it before the phase hooks, which then time it as sync_weights."""
    generation = getattr(trainer, "vllm_generation", None)
    how = fast_sync_plan(generation) if generation is not None else None
    if how is None:
        return "weight sync: TRL's own (no batched sync for this backend)"
    if why_not := upstream_mismatch("batched weight sync"):
        return f"weight sync: {why_not}"
    chunk = chunk_bytes if how == "chunked" else None
    # An instance attribute shadows the class's method for every caller: GRPOTrainer's sync before generation and
    # VLLMGeneration.generate's re-sync of weights still asleep.
    generation.sync_weights = functools.partial(_batched_sync, generation, chunk)
    return f"weight sync: {how}"


# ------------------------------------------------------------------ importance-sampling ratio from the training forward
#
# With vLLM's importance-sampling correction on (TRL's default), GRPOTrainer runs a no-grad forward over the whole
# generation batch to get the "old" log-probs, even on-policy, where they equal the detached log-probs of the training
# forward itself (trl#5412). On-policy, this computes TRL's ratio exp(old - sampling), masked or truncated as the mode
# says, from the training forward of each micro-batch instead, and logs TRL's sampling/* metrics over the same
# generation batch, so that one forward per micro-batch remains.

IS_RATIO_METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def one_forward_plan(trainer) -> str | None:
    """None where the ratio can come from the training forward; else why TRL's extra forward stays."""
    args = trainer.args
    if not (args.use_vllm and args.vllm_importance_sampling_correction):
        return "no vLLM importance-sampling correction, so no extra forward to save"
    if args.num_iterations > 1:
        return f"trainer.num_iterations={args.num_iterations} reuses a generation after an update (off-policy)"
    if args.gradient_accumulation_steps % args.steps_per_generation:
        return (
            f"trainer.gradient_accumulation_steps={args.gradient_accumulation_steps} is not a multiple of "
            f"steps_per_generation={args.steps_per_generation}: updates land inside a generation (off-policy)"
        )
    if args.use_liger_kernel:
        return "trainer.use_liger_kernel computes the loss without TRL's log-prob forward"
    return None


def vllm_is_ratio(logps, sampling_logps, mask, mode: str, clip_min, clip_max):
    """TRL's vLLM importance-sampling ratio (GRPOTrainer._generate_and_score_completions): exp(logps - sampling),
    per token or summed per sequence, then truncated or masked to [clip_min, clip_max]. NaN sampling log-probs
    (tokens vLLM could not score) count as no difference."""
    import torch

    diff = torch.nan_to_num((logps - sampling_logps) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in ("sequence_mask", "token_mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}")


class _GenerationStats:
    """What TRL's sampling/* metrics summarise over one process's generation batch, gathered micro-batch by
    micro-batch: |logps - sampling| over the scored completion tokens, and the ratio over completion tokens (token
    modes) or sequences (sequence modes). Kept on the device: nothing waits for the GPU between a micro-batch's
    forward and its backward; the values cross to the host once, when the generation batch is logged."""

    # delta sum, delta count, delta max, ratio sum, ratio count, ratio min, ratio max
    SUMS, MAXES, MINS = (0, 1, 3, 4), (2, 6), (5,)

    def __init__(self):
        self.totals = None
        self.micro_batches = 0

    def add(self, logps, sampling_logps, mask, ratio, per_sequence: bool) -> None:
        import torch

        delta = (logps - sampling_logps).abs()
        scored = mask.bool() & ~delta.isnan()
        counted = torch.ones_like(ratio, dtype=torch.bool) if per_sequence else mask.bool()
        stats = torch.stack(
            [
                delta.masked_fill(~scored, 0.0).sum(),
                scored.sum(),
                delta.masked_fill(~scored, 0.0).max(),  # |delta| >= 0: an empty batch gives 0
                ratio.masked_fill(~counted, 0.0).sum(),
                counted.sum(),
                ratio.masked_fill(~counted, math.inf).min(),
                ratio.masked_fill(~counted, -math.inf).max(),
            ]
        ).float()
        if self.totals is None:
            self.totals = stats
        else:
            t = self.totals
            t[list(self.SUMS)] += stats[list(self.SUMS)]
            t[list(self.MAXES)] = torch.maximum(t[list(self.MAXES)], stats[list(self.MAXES)])
            t[list(self.MINS)] = torch.minimum(t[list(self.MINS)], stats[list(self.MINS)])
        self.micro_batches += 1

    def per_process(self):
        """The five values TRL computes on each process, in IS_RATIO_METRICS' order (0 where nothing counted), as
        one tensor on the device."""
        import torch

        d_sum, d_n, d_max, r_sum, r_n, r_min, r_max = self.totals.unbind()
        zero = torch.zeros_like(d_sum)
        return torch.stack(
            [
                torch.where(d_n > 0, d_sum / d_n.clamp(min=1), zero),
                d_max,
                torch.where(r_n > 0, r_min, zero),
                torch.where(r_n > 0, r_sum / r_n.clamp(min=1), zero),
                torch.where(r_n > 0, r_max, zero),
            ]
        )


class OneForward:
    """Installed on one GRPOTrainer (instance attributes shadow its methods): generation on-policy skips TRL's
    old-log-prob forward, and each training micro-batch gets its importance-sampling ratio from its own forward."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.pending: dict | None = None  # the micro-batch whose training forward is running
        self.stats = _GenerationStats()
        self.generate_and_score = trainer._generate_and_score_completions
        self.compute_loss = trainer._compute_loss
        self.logps = trainer._get_per_token_logps_and_entropies
        trainer._generate_and_score_completions = self._generate_and_score_completions
        trainer._compute_loss = self._compute_loss
        trainer._get_per_token_logps_and_entropies = self._get_per_token_logps_and_entropies

    def _generate_and_score_completions(self, *args, **kwargs):
        trainer = self.trainer
        if not trainer.model.training:  # evaluation keeps TRL's path
            return self.generate_and_score(*args, **kwargs)
        self.stats = _GenerationStats()
        # With the correction off, TRL computes no old log-probs on-policy and no ratio; the sampled log-probs stay
        trainer.vllm_importance_sampling_correction = False
        try:
            return self.generate_and_score(*args, **kwargs)
        finally:
            trainer.vllm_importance_sampling_correction = True

    def _compute_loss(self, model, inputs):
        ours = (
            self.trainer.model.training
            and "importance_sampling_ratio" not in inputs
            and inputs.get("sampling_per_token_logps") is not None
        )
        self.pending = inputs if ours else None
        try:
            return self.compute_loss(model, inputs)
        finally:
            self.pending = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        result = self.logps(*args, **kwargs)
        if (inputs := self.pending) is not None:  # the training forward of _compute_loss: its first call
            self.pending = None
            self._add_ratio(inputs, result[0].detach())
        return result

    def _add_ratio(self, inputs: dict, logps) -> None:
        trainer = self.trainer
        sampling = inputs["sampling_per_token_logps"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        mode = trainer.vllm_importance_sampling_mode
        clip = trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max
        ratio = vllm_is_ratio(logps, sampling, mask, mode, *clip)
        inputs["importance_sampling_ratio"] = ratio  # read by _compute_loss after this forward
        self.stats.add(logps, sampling, mask, ratio, per_sequence=mode.startswith("sequence"))
        if self.stats.micro_batches == trainer.args.steps_per_generation:  # the generation batch is done
            self._log(self.stats.per_process())

    def _log(self, values) -> None:
        """Gather each process's values (a tensor on its device) and reduce them as TRL does (mean of means, max of
        maxes, …)."""
        import torch
        from trl.trainer.utils import nanmax, nanmin

        trainer = self.trainer
        gathered = trainer.accelerator.gather(values.to(trainer.accelerator.device).unsqueeze(0))
        gathered = gathered.view(-1, values.numel())
        reduce = (torch.mean, torch.max, nanmin, torch.nanmean, nanmax)
        reduced = torch.stack([how(column) for how, column in zip(reduce, gathered.unbind(dim=1), strict=True)])
        for name, value in zip(IS_RATIO_METRICS, reduced.tolist(), strict=True):  # one copy to the host
            trainer._metrics["train"][name].append(value)


def install_one_forward(trainer) -> str:
    """Take the vLLM importance-sampling ratio from the training forward where training is on-policy; returns one
    line saying which path runs."""
    if why_not := one_forward_plan(trainer):
        return f"importance-sampling ratio: TRL's extra forward ({why_not})"
    if why_not := upstream_mismatch("importance-sampling ratio from the training forward"):
        return why_not
    OneForward(trainer)
    return "importance-sampling ratio: from the training forward (on-policy: TRL's extra no-grad forward skipped)"


def install_changes(trainer, *, seed: int, flat_logprobs: bool, sync_chunk_bytes: int | None, one_forward: bool):
    """Every change of ours to a built GRPOTrainer, in one fixed order: the engine's seed (trl#7040), the flat
    log-prob reader, the batched weight sync (before the phase hooks, which then time it), the importance-sampling
    ratio from the training forward. Returns one line for each that says what runs (TRL's own code where its source
    is not the one ours was written for)."""
    reseed_generation(trainer, seed)
    lines = []
    if flat_logprobs and (why_not := install_flat_logprob_reader()):
        lines.append(why_not)
    if sync_chunk_bytes is not None:
        lines.append(install_fast_sync(trainer, sync_chunk_bytes))
    if one_forward:
        lines.append(install_one_forward(trainer))
    return lines
