"""Our GRPOTrainer: TRL's (timed: compat/grpo_trainer.py), with explicit overrides, read top-down in the order a step's
data flows through them: the engine's seed (trl#7040), the flat log-prob reader and the batched weight sync (turned on
in the in-process engine, generation/in_process.py), the importance-sampling ratio from the training forward, and
packed (training/packing.py) and balanced (training/micro_batches.py) micro-batches. Each is on where it applies and
TRL's source is the one it was written for (the upstream guard); one log line each says what runs.
EngineProcessGRPOTrainer is the same with the engine in a process of its own (generation/engine_process.py)."""

from __future__ import annotations

import inspect
import logging
import math

import torch
from trl import GRPOTrainer

from colocated_grpo.compat.grpo_trainer import TimedGRPOTrainer, upstream_mismatch
from colocated_grpo.generation import engine_process
from colocated_grpo.generation.in_process import ColocatedVLLMGeneration, fast_sync_plan
from colocated_grpo.training import micro_batches, packing

log = logging.getLogger(__name__)


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
        micro-batch's forward over its sequences packed into one row, without padding (training/packing.py);
        `balance_micro_batches`, each optimizer step's rows regrouped by length (training/micro_batches.py)."""
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
        log.info("micro-batches: packed, without padding (%s)", packing.kernel(model.dtype))
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
        given = _forward_arguments(*args, **kwargs)
        result = self._packed_logps_and_entropies(given) if self.pack_micro_batches else None
        self._count_forward(result is not None, given.get("attention_mask"))
        if result is None:
            result = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if (inputs := self._pending) is not None:  # the training forward of _compute_loss: its first call
            self._pending = None
            self._add_ratio(inputs, result[0].detach())
        return result

    def _packed_logps_and_entropies(self, given: dict):
        """TRL's _get_per_token_logps_and_entropies (`given`: its call's arguments by name) over packed micro-batches
        of `batch_size` rows, where the inputs are text alone; None for a call that carries more (images), which TRL's
        padded forward computes."""
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

    def _count_forward(self, packed: bool, mask) -> None:
        """Per step, the share of forwards that ran packed and the share of the tokens they computed that were padding
        (each a mean over the step's forwards: training, and TRL's no-grad ones where they run); `mask`, the forward's
        attention mask."""
        if not self.model.training or mask is None:  # evaluation; a call without a batch (a stand-in of TRL's)
            return
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


class EngineProcessGRPOTrainer(engine_process.EngineProcessTrainer, ColocatedGRPOTrainer):
    """ColocatedGRPOTrainer with each rank's engine in a process of its own (placement=colocate_process), and overlap
    where asked: generation/engine_process.py."""
