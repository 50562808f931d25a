"""Our GRPOTrainer: TRL's, with explicit overrides, read top-down in the order a step's data flows through them.
TimedGRPOTrainer only times TRL's steps (the phases: docs/telemetry.md) and calls TRL's own code: the plain-TRL
baseline runs it. ColocatedGRPOTrainer adds our changes: the engine's seed (trl#7040), the flat log-prob reader, the
batched weight sync (ColocatedVLLMGeneration), the importance-sampling ratio from the training forward. Each change
names the TRL methods it relies on with a digest of their source as written for trl 1.16.0 (`WRITTEN_FOR`), checked
on the class that runs (a subclass of ours that overrides one is seen): where one differs, TRL's own code runs for
that change and a WARNING names the speed lost."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import math
from contextlib import contextmanager, nullcontext

import torch
import trl
from torch.profiler import record_function
from trl import GRPOTrainer

from colocated_grpo.compat import micro_batches, packing
from colocated_grpo.compat import trl as trl_internals

try:  # where TRL 1.16 keeps its engine wrapper; a TRL that moves it runs its own generation (the guard says so)
    from trl.generation import vllm_generation
except ImportError:
    vllm_generation = None

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------ the upstream guard

WRITTEN_FOR_VERSION = "1.16.0"
WRITTEN_FOR = {
    # TRL's generate returns (prompt ids, completion ids, …) per completion: the generated tokens counted from it
    "token counts": {"trl.trainer.grpo_trainer:GRPOTrainer._generate": "2a27fdf8f5e6"},
    "flat log-prob reader": {
        "trl.generation.vllm_generation:extract_logprobs": "ea9254b4a72d",
        # which calls extract_logprobs by its module's name: the seam our reader stands in at
        "trl.generation.vllm_generation:VLLMGeneration.generate": "2d2ac2be5b13",
    },
    "batched weight sync": {
        "trl.generation.vllm_generation:VLLMGeneration.sync_weights": "63d669fb3230",
        "trl.generation.vllm_generation:VLLMGeneration._iter_named_params": "baab615d5c7b",
    },
    "importance-sampling ratio from the training forward": {
        "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions": "1fa48922792d",
        "trl.trainer.grpo_trainer:GRPOTrainer._prepare_inputs": "f824e7fb0714",
        "trl.trainer.grpo_trainer:GRPOTrainer.compute_loss": "a2d6ef8bd29c",
        "trl.trainer.grpo_trainer:GRPOTrainer._compute_loss": "80295546bbdb",
        "trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies": "ea73c3909275",
    },
    "packed micro-batches": {
        "trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies": "ea73c3909275",
        "trl.trainer.utils:add_fused_lm_head": "422d009f04b6",  # the (rows, length - 1) log-probs it returns
    },
    "balanced micro-batches": {
        # the buffer of micro-batches it fills once a generation batch, and the losses that micro-batches' makeup
        # leaves unchanged
        "trl.trainer.grpo_trainer:GRPOTrainer._prepare_inputs": "f824e7fb0714",
        "trl.trainer.grpo_trainer:GRPOTrainer._compute_loss": "80295546bbdb",
    },
}
# What TRL's own code costs where a change falls back to it (one H200, docs/results.md).
SPEED_LOST = {
    "token counts": "no generated tokens counted: perf/tokens_per_s and perf/gen_tokens_per_s read 0",
    "flat log-prob reader": "slower generation: TRL's parser builds a dict per generated token",
    "batched weight sync": "a slower weight sync: one load_weights call per tensor (0.27 s instead of 0.02 s for 1.5B)",
    "importance-sampling ratio from the training forward": (
        "a slower step: TRL's extra no-grad forward over each generation batch (0.69 s of a step at 256 completions)"
    ),
    "packed micro-batches": "padded micro-batches: every sequence computed to the micro-batch's longest",
    "balanced micro-batches": "TRL's micro-batches, each padded to the generation batch's longest row",
}


OURS = "colocated_grpo."  # the package whose overrides reach TRL's methods through super()


def _running(target: str, cls: type | None) -> tuple[str, str | None]:
    """The name and source of what runs for `module:Class.method`: on `cls` (a subclass of Class), the first
    definition in its MRO that is not one of ours, which our overrides reach through super(); (name, None) where
    it does not exist."""
    module_name, _, qualname = target.partition(":")
    path, _, name = qualname.rpartition(".")
    try:
        owner = importlib.import_module(module_name)
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        if cls is not None and isinstance(owner, type) and issubclass(cls, owner):
            owner = next(k for k in cls.__mro__ if name in vars(k) and not k.__module__.startswith(OURS))
            qualname = f"{owner.__qualname__}.{name}"
        obj = getattr(owner, name)
        return qualname, inspect.getsource(getattr(obj, "trl_original", obj))  # ours installed: TRL's own
    except (ImportError, AttributeError, OSError, TypeError, StopIteration):
        return qualname, None


def changed_upstream(targets: dict[str, str], *classes: type) -> list[str]:
    """The methods of `targets` (`module:Class.method` -> the digest of the source it was written for) whose source,
    as each of `classes` runs it (subclasses of their Class), is another or gone."""
    changed = []
    for target, digest in targets.items():
        for name, source in (_running(target, cls) for cls in classes or (None,)):
            if (source is None or hashlib.sha256(source.encode()).hexdigest()[:12] != digest) and name not in changed:
                changed.append(name)
    return changed


def upstream_mismatch(change: str, cls: type | None = None) -> str | None:
    """None when every TRL method `change` relies on has the source it was written for (as `cls` runs it); else one
    line saying that TRL's own code runs, why, and the speed lost."""
    changed = changed_upstream(WRITTEN_FOR[change], cls)
    if not changed:
        return None
    return (
        f"{change}: TRL's own code runs: written for trl {WRITTEN_FOR_VERSION}, this is trl {trl.__version__} "
        f"and {', '.join(changed)} changed; {SPEED_LOST[change]}"
    )


# ------------------------------------------------------------------------------------ timing only: TRL's behaviour


def _in_phase(tracker, name: str):
    return nullcontext() if tracker is None else tracker.phase(name)


# TRL's engine wrapper; without it (a TRL that moved it) the wrapper TRL builds keeps its own class
_VLLMGeneration = vllm_generation.VLLMGeneration if vllm_generation is not None else object


class TimedVLLMGeneration(_VLLMGeneration):
    """TRL's engine wrapper, its weight sync timed as the sync_weights phase."""

    phase_tracker = None  # a telemetry.phases.PhaseTracker (TimedGRPOTrainer.time_phases)

    def sync_weights(self):
        with _in_phase(self.phase_tracker, "sync_weights"):
            return super().sync_weights()


class TimedGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with its steps timed as phases and its generated tokens counted; each override times and
    calls TRL's own. Phases nest: generate inside other (_prepare_inputs) inside train (training_step)."""

    vllm_generation_class = TimedVLLMGeneration
    phase_tracker = token_counter = None  # set by time_phases
    counts_tokens = True  # TRL's _generate returns what the counts read (the upstream guard)
    profile_label = None  # telemetry.profile's prefix: train, other and generate then run in torch.profiler ranges

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        timed = ("_prepare_inputs", "_generate", "_calculate_rewards")
        if missing := [name for name in timed if not hasattr(GRPOTrainer, name)]:
            log.warning("phase timings: this TRL's GRPOTrainer has no %s; those phases read 0", ", ".join(missing))
        if why_not := upstream_mismatch("token counts", type(self)):
            log.warning("%s", why_not)
            self.counts_tokens = False
        if isinstance(getattr(self, "vllm_generation", None), _VLLMGeneration) and vllm_generation is not None:
            # TRL 1.16 builds VLLMGeneration by name inside GRPOTrainer.__init__, with no factory to override: the
            # built object takes our subclass (methods only, no state of its own)
            self.vllm_generation.__class__ = self.vllm_generation_class
        elif getattr(self, "vllm_generation", None) is not None:
            log.warning("phase timings: this TRL has no trl.generation.vllm_generation; sync_weights reads 0")

    def time_phases(self, tracker, tokens) -> None:
        """Time TRL's steps as phases of `tracker` and count generated tokens into `tokens` (telemetry.phases)."""
        self.phase_tracker, self.token_counter = tracker, tokens
        if (generation := getattr(self, "vllm_generation", None)) is None:
            return
        generation.phase_tracker = tracker
        llm = getattr(generation, "llm", None)  # the in-process engine: colocate only
        if llm is not None and generation.enable_sleep_mode:
            # vLLM's LLM is built and called inside TRL's own VLLMGeneration methods: only its instance can be timed
            for name in ("sleep", "wake_up"):
                setattr(llm, name, tracker.phase("sleep_wake")(getattr(llm, name)))  # a contextmanager decorates too

    @contextmanager
    def _phase(self, name: str, labelled: bool = False):
        label = record_function(self.profile_label + name) if labelled and self.profile_label else nullcontext()
        with label, _in_phase(self.phase_tracker, name):
            yield

    def training_step(self, *args, **kwargs):
        with self._phase("train", labelled=True):
            return super().training_step(*args, **kwargs)

    def _prepare_inputs(self, *args, **kwargs):
        with self._phase("other", labelled=True):
            return super()._prepare_inputs(*args, **kwargs)

    def _generate(self, *args, **kwargs):
        with self._phase("generate", labelled=True):
            result = super()._generate(*args, **kwargs)
        if self.token_counter is not None and self.counts_tokens:
            self.token_counter.count(result[0], result[1])
        return result

    def _calculate_rewards(self, *args, **kwargs):
        with self._phase("reward"):
            return super()._calculate_rewards(*args, **kwargs)

    def _clip_grad_norm(self, *args, **kwargs):
        with self._phase("train"):
            return super()._clip_grad_norm(*args, **kwargs)


# ------------------------------------------------------------------------------------------------ our changes
#
# Weight sync: TRL's VLLMGeneration.sync_weights calls the engine model's `load_weights([(name, tensor)])` once per
# tensor, and each call walks every module of the model: tensors × modules of Python work per sync. The same tensors
# in one call (or a few, where FSDP2 gathers them) land the same weights in a fraction of the time.


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


class ColocatedVLLMGeneration(TimedVLLMGeneration):
    """The engine wrapper whose colocated sync loads the weights in one load_weights call, or one per chunk, and
    whose outputs are read by the flat log-prob reader."""

    batched_sync = False  # set by ColocatedGRPOTrainer where fast_sync_plan allows it
    sync_chunk_bytes: int | None = None  # None: one call
    flat_logprobs = False  # set by ColocatedGRPOTrainer where the request asks for flat log-probs

    def generate(self, *args, **kwargs):
        if not self.flat_logprobs:
            return super().generate(*args, **kwargs)
        # TRL's generate calls its module's extract_logprobs by name: our reader stands in for this call only
        original = vllm_generation.extract_logprobs

        def read(outputs):
            return trl_internals.read_flat_logprobs(outputs, fallback=original)

        vllm_generation.extract_logprobs = read
        try:
            return super().generate(*args, **kwargs)
        finally:
            vllm_generation.extract_logprobs = original

    def sync_weights(self):  # GRPOTrainer's sync before generation, and generate's re-sync of weights asleep
        if not self.batched_sync:
            return super().sync_weights()
        with _in_phase(self.phase_tracker, "sync_weights"):
            if self.enable_sleep_mode:  # as TRL: map the weights back in before writing into them
                vllm_generation.empty_cache()
                self.llm.wake_up(tags=["weights"])
                self._llm_weights_sleeping = False
            load = self.llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights  # as TRL's
            pending, size = [], 0
            # TRL's own iterator: its name fixes, and FSDP2's full_tensor() gathers (collectives: every rank iterates)
            for name, tensor in self._iter_named_params():
                pending.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
                if self.sync_chunk_bytes is not None and size >= self.sync_chunk_bytes:
                    load(pending)
                    pending, size = [], 0
            if pending:
                load(pending)
            del pending  # FSDP2's gathered copies go before generation
            self.llm.reset_prefix_cache()  # as TRL: cached KV was computed with the old weights


# Importance-sampling ratio from the training forward: with vLLM's importance-sampling correction on (TRL's default),
# GRPOTrainer runs a no-grad forward over the whole generation batch to get the "old" log-probs, even on-policy, where
# they equal the detached log-probs of the training forward itself (trl#5412). On-policy, this computes TRL's ratio
# exp(old - sampling), masked or truncated as the mode says, from the training forward of each micro-batch instead,
# and logs TRL's sampling/* metrics over the same generation batch, so that one forward per micro-batch remains. Both
# forwards compute the same log-probs up to the nondeterminism of a forward (kernels, reduction order); TRL's
# clip_ratio/* metrics read 0 (the loss's own ratio is exactly 1); with dropout > 0 the two forwards differ, so the
# ratio does too.

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
    if args.use_liger_kernel and (args.liger_kernel_config or {}).get("fused_linear_cross_entropy"):
        # TRL 1.16 turns Liger's fused loss off (layer kernels only: RoPE, RMSNorm, SwiGLU), so its log-prob forward,
        # and the ratio read from it, stay TRL's own; a fused loss would replace that forward
        return "trainer.use_liger_kernel with Liger's fused linear cross-entropy replaces TRL's log-prob forward"
    return None


def vllm_is_ratio(logps, sampling_logps, mask, mode: str, clip_min, clip_max):
    """TRL's vLLM importance-sampling ratio (GRPOTrainer._generate_and_score_completions): exp(logps - sampling),
    per token or summed per sequence, then truncated or masked to [clip_min, clip_max]. NaN sampling log-probs
    (tokens vLLM could not score) count as no difference."""
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

    def __init__(self):
        self.batches = []  # per micro-batch: delta sum, count and max; ratio sum, count, min and max

    def add(self, logps, sampling_logps, mask, ratio, per_sequence: bool) -> None:
        delta = (logps - sampling_logps).abs()
        scored = mask.bool() & ~delta.isnan()
        scored_delta = delta.masked_fill(~scored, 0.0)
        counted = torch.ones_like(ratio, dtype=torch.bool) if per_sequence else mask.bool()
        stats = torch.stack(
            [
                scored_delta.sum(),
                scored.sum(),
                scored_delta.max(),  # |delta| >= 0: an empty batch gives 0
                ratio.masked_fill(~counted, 0.0).sum(),
                counted.sum(),
                ratio.masked_fill(~counted, math.inf).min(),
                ratio.masked_fill(~counted, -math.inf).max(),
            ]
        ).float()
        self.batches.append(stats)

    def per_process(self):
        """The five values TRL computes on each process, in IS_RATIO_METRICS' order (0 where nothing counted), as
        one tensor on the device."""
        batches = torch.stack(self.batches)
        sums, mins, maxes = batches.sum(0), batches.amin(0), batches.amax(0)
        d_sum, d_n, d_max, r_sum, r_n, r_min, r_max = sums[0], sums[1], maxes[2], sums[3], sums[4], mins[5], maxes[6]
        delta = torch.stack([torch.where(d_n > 0, d_sum / d_n.clamp(min=1), 0.0), d_max])
        return torch.cat([delta, torch.where(r_n > 0, torch.stack([r_min, r_sum / r_n.clamp(min=1), r_max]), 0.0)])


# TRL's _get_per_token_logps_and_entropies's arguments that the packed forward takes; any other (images, an MoE's
# auxiliary loss) is TRL's padded forward's
TEXT_ARGUMENTS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy")


def _forward_arguments(*args, **kwargs) -> dict:
    """A call of TRL's _get_per_token_logps_and_entropies, its arguments by name, defaults included (self first)."""
    call = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).bind(None, *args, **kwargs)
    call.apply_defaults()
    return call.arguments


class ColocatedGRPOTrainer(TimedGRPOTrainer):
    """TimedGRPOTrainer with our changes, each on where it applies and TRL's source is the one it was written for;
    one log line each says what runs."""

    vllm_generation_class = ColocatedVLLMGeneration
    one_forward = False  # the ratio from the training forward, where it applies
    _pending: dict | None = None  # the micro-batch whose training forward is running

    def __init__(
        self,
        *args,
        seed: int | None = None,
        flat_logprobs: bool | None = None,
        sync_chunk_bytes: int | None = 2**30,
        one_forward: bool = True,
        pack_micro_batches: bool = False,
        balance_micro_batches: bool = False,
        **kwargs,
    ):
        """TRL's arguments, and ours: `seed` for the engine's sampling (None: args.seed); `flat_logprobs`, the flat
        log-prob reader (None: where args.generation_kwargs asks vLLM for flat_logprobs); `sync_chunk_bytes`, the
        batched weight sync's chunk of gathered FSDP2 weights (None: TRL's own sync); `one_forward`, the
        importance-sampling ratio from the training forward where training is on-policy; `pack_micro_batches`, each
        micro-batch's forward over its sequences packed into one row, without padding (compat/packing.py);
        `balance_micro_batches`, each optimizer step's rows regrouped by length (compat/micro_batches.py)."""
        super().__init__(*args, **kwargs)
        self._reseed_generation(self.args.seed if seed is None else seed)
        if flat_logprobs is None:
            flat_logprobs = bool((self.args.generation_kwargs or {}).get("flat_logprobs"))
        if flat_logprobs:
            self._read_flat_logprobs()
        if sync_chunk_bytes is not None:
            self._batch_weight_sync(sync_chunk_bytes)
        self.one_forward = one_forward and self._one_forward_applies()
        self.pack_micro_batches = pack_micro_batches and self._packing_applies()
        self.balance_micro_batches = balance_micro_batches and self._balancing_applies()
        self._stats = _GenerationStats()

    def _reseed_generation(self, seed: int) -> None:
        """Make the seed reach vLLM's sampling (trl#7040): TRL seeds the colocated engine with rank // tp, which
        reseeds torch's global RNG, so every `seed` gave the same rollouts. Reseeded here after the engine exists, one
        seed per data-parallel group (the ranks of one TP group must sample identically)."""
        import numpy as np
        from transformers import set_seed

        if not (self.args.use_vllm and self.args.vllm_mode == "colocate"):
            return
        dp_rank = self.accelerator.process_index // self.args.vllm_tensor_parallel_size
        set_seed(int(np.random.SeedSequence([seed, dp_rank]).generate_state(1)[0]))

    def _read_flat_logprobs(self) -> None:
        generation = getattr(self, "vllm_generation", None)
        if not isinstance(generation, ColocatedVLLMGeneration):
            return
        if why_not := upstream_mismatch("flat log-prob reader", type(generation)):
            return log.warning("%s", why_not)
        generation.flat_logprobs = True

    def _batch_weight_sync(self, chunk_bytes: int) -> None:
        generation = getattr(self, "vllm_generation", None)
        how = fast_sync_plan(generation) if generation is not None else None
        if how is None:
            return log.info("weight sync: TRL's own (no batched sync for this backend)")
        if why_not := upstream_mismatch("batched weight sync", type(generation)):
            return log.warning("%s", f"weight sync: {why_not}")
        generation.batched_sync = True
        generation.sync_chunk_bytes = chunk_bytes if how == "chunked" else None
        log.info(f"weight sync: {how}")

    def _one_forward_applies(self) -> bool:
        if why_not := one_forward_plan(self):
            log.info(f"importance-sampling ratio: TRL's extra forward ({why_not})")
            return False
        if why_not := upstream_mismatch("importance-sampling ratio from the training forward", type(self)):
            log.warning("%s", why_not)
            return False
        log.info(
            "importance-sampling ratio: from the training forward (on-policy: TRL's extra no-grad forward skipped)"
        )
        return True

    def _packing_applies(self) -> bool:
        model = self.accelerator.unwrap_model(self.model)
        if not model._can_set_attn_implementation():
            why_not = f"{type(model).__name__} sets no attention function"
        elif self.aux_loss_enabled:
            why_not = "the packed forward computes no MoE auxiliary loss"
        else:
            why_not = packing.why_not_packable(model) or upstream_mismatch("packed micro-batches", type(self))
        if why_not:
            log.warning("micro-batches: padded, not packed (%s)", why_not)
            return False
        for packed in (model, self.ref_model):  # the reference model's forward is packed too (beta > 0)
            if packed is not None:
                packing.make_packable(self.accelerator.unwrap_model(packed).config)
        log.info("micro-batches: packed, without padding (%s)", packing.kernel())
        return True

    def _balancing_applies(self) -> bool:
        why_not = micro_batches.why_not(self.args) or upstream_mismatch("balanced micro-batches", type(self))
        if why_not:
            log.warning("micro-batches: TRL's, not balanced (%s)", why_not)
            return False
        how = "equal tokens" if self.pack_micro_batches else "similar lengths together, each cut to its longest"
        log.info("micro-batches: balanced in each optimizer step (%s)", how)
        return True

    def _prepare_inputs(self, generation_batch):
        before = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        if not self.model.training or self._buffered_inputs is before:
            return inputs
        buffered = self._buffered_inputs
        if self.balance_micro_batches:
            per_step = self.args.gradient_accumulation_steps
            with self._phase("other"):
                regrouped = micro_batches.regroup(buffered, per_step, self.pack_micro_batches)
            if regrouped is not None:
                self._buffered_inputs = buffered = regrouped
                inputs = buffered[self._step % self.args.steps_per_generation]
        return inputs

    def _generate_and_score_completions(self, *args, **kwargs):
        if not (self.one_forward and self.model.training):  # evaluation keeps TRL's path
            return super()._generate_and_score_completions(*args, **kwargs)
        self._stats = _GenerationStats()
        # With the correction off, TRL computes no old log-probs on-policy and no ratio; the sampled log-probs stay
        correction, self.vllm_importance_sampling_correction = self.vllm_importance_sampling_correction, False
        try:
            return super()._generate_and_score_completions(*args, **kwargs)
        finally:
            self.vllm_importance_sampling_correction = correction

    def _compute_loss(self, model, inputs):
        unscored = "importance_sampling_ratio" not in inputs and inputs.get("sampling_per_token_logps") is not None
        if self.one_forward and self.model.training and unscored:
            inputs = self._pending = dict(inputs)  # TRL's buffered micro-batch stays as TRL made it
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._pending = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        result = self._packed_logps_and_entropies(*args, **kwargs) if self.pack_micro_batches else None
        self._count_forward(result is not None, *args, **kwargs)
        if result is None:
            result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if (inputs := self._pending) is not None:  # the training forward of _compute_loss: its first call
            self._pending = None
            self._add_ratio(inputs, result[0].detach())
        return result

    def _packed_logps_and_entropies(self, *args, **kwargs):
        """TRL's _get_per_token_logps_and_entropies over packed micro-batches of `batch_size` rows, where the inputs
        are text alone; None for a call that carries more (images), which TRL's padded forward computes."""
        given = _forward_arguments(*args, **kwargs)
        if given["compute_aux_loss"] or any(
            value is not None for name, value in given.items() if name not in (*TEXT_ARGUMENTS, "compute_aux_loss")
        ):
            return None
        model, input_ids, attention_mask = given["model"], given["input_ids"], given["attention_mask"]
        keep, entropy = given["logits_to_keep"], given["compute_entropy"]
        rows = given["batch_size"] or input_ids.size(0)
        config = self.accelerator.unwrap_model(model).config
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), rows):
            batch = slice(start, start + rows)
            with self.accelerator.autocast():
                lp, ent = packing.per_token_logps(model, config, input_ids[batch], attention_mask[batch], keep, entropy)
            logps.append(lp)
            entropies.append(ent)
        return torch.cat(logps), torch.cat(entropies) if entropy else None, None

    def _count_forward(self, packed: bool, *args, **kwargs) -> None:
        """Per step, the share of forwards that ran packed and the share of the tokens they computed that were padding
        (each a mean over the step's forwards: training, and TRL's no-grad ones where they run)."""
        if not self.model.training:
            return
        given = _forward_arguments(*args, **kwargs)
        mask = given["attention_mask"]
        padding = 0.0 if packed else 1.0 - mask.sum().item() / mask.numel()
        self._metrics["train"]["micro_batches/packed_share"].append(float(packed))
        self._metrics["train"]["micro_batches/padding_share"].append(padding)

    def _add_ratio(self, inputs: dict, logps) -> None:
        sampling = inputs["sampling_per_token_logps"]
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        mode = self.vllm_importance_sampling_mode
        clip = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        ratio = vllm_is_ratio(logps, sampling, mask, mode, *clip)
        inputs["importance_sampling_ratio"] = ratio  # read by TRL's _compute_loss after this forward
        self._stats.add(logps, sampling, mask, ratio, per_sequence=mode.startswith("sequence"))
        if len(self._stats.batches) == self.args.steps_per_generation:  # the generation batch is done
            self._log_ratio_metrics(self._stats.per_process())

    def _log_ratio_metrics(self, values) -> None:
        """Gather each process's values (a tensor on its device) and reduce them as TRL does (mean of means, max of
        maxes, …)."""
        from trl.trainer.utils import nanmax, nanmin

        gathered = self.accelerator.gather(values.to(self.accelerator.device).unsqueeze(0)).view(-1, values.numel())
        reduce = (torch.mean, torch.max, nanmin, torch.nanmean, nanmax)
        reduced = torch.stack([how(column) for how, column in zip(reduce, gathered.unbind(dim=1), strict=True)])
        for name, value in zip(IS_RATIO_METRICS, reduced.tolist(), strict=True):  # one copy to the host
            self._metrics["train"][name].append(value)
