"""Micro-batches balanced by tokens (run.balance_micro_batches). TRL shuffles a generation batch and splits it into
micro-batches of equal row counts, every one padded to the longest prompt and the longest completion of the whole
generation batch. Here the rows of each optimizer step's micro-batches are regrouped, still in equal counts:
  - padded micro-batches: the rows of similar lengths together, each micro-batch cut to its own longest prompt and
    completion (columns that are padding in every row), so that short rows stop paying for the longest;
  - packed micro-batches (run.pack_micro_batches): about the same number of tokens in each, so that no micro-batch
    holds more activations than it must.
An optimizer step keeps its rows, and each micro-batch its row count, so losses that normalize by the step's tokens
or by each micro-batch's rows (every TRL loss but `bnpo`) and their gradients are unchanged."""

from __future__ import annotations

import torch

PROMPT_KEYS = ("prompt_ids", "prompt_mask")  # left-padded; every other (rows, width) tensor is per completion token
TEXT_KEYS = {
    *PROMPT_KEYS,
    "completion_ids",
    "completion_mask",
    "advantages",
    "num_items_in_batch",
    "old_per_token_logps",
    "importance_sampling_ratio",
    "sampling_per_token_logps",
    "ref_per_token_logps",
    "tool_mask",
}


def why_not(args) -> str | None:
    """Why regrouping would change the loss or cross an optimizer step under these GRPOConfig `args`; None where it
    does not."""
    if args.loss_type == "bnpo":
        return "loss_type=bnpo normalizes by each micro-batch's tokens"
    if args.top_entropy_quantile < 1.0:
        return "top_entropy_quantile < 1 masks by each micro-batch's entropies"
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy:
        return "the entropy bonus is a mean over each micro-batch's tokens"
    per_step = args.gradient_accumulation_steps
    if args.steps_per_generation % per_step:
        return (
            f"steps_per_generation={args.steps_per_generation} is no multiple of gradient_accumulation_steps={per_step}"
        )
    return None


def regroup(micro_batches: list[dict], per_step: int, packed: bool) -> list[dict] | None:
    """`micro_batches` (TRL's buffer, in order) regrouped within each run of `per_step` (one optimizer step's), each
    cut to its own longest row; None where a micro-batch holds more than text (images: TRL's micro-batches stay)."""
    if any(set(batch) - TEXT_KEYS for batch in micro_batches):
        return None
    regrouped = []
    for start in range(0, len(micro_batches), per_step):
        step = micro_batches[start : start + per_step]
        rows = len(step[0]["prompt_ids"])
        whole = {key: _concatenated([batch[key] for batch in step], rows) for key in step[0]}
        for group in groups(lengths(whole).tolist(), len(step), packed):
            index = torch.tensor(sorted(group))  # TRL's shuffled order within a micro-batch
            regrouped.append(_trimmed({key: _rows(value, index) for key, value in whole.items()}))
    return regrouped


def groups(row_lengths: list[int], count: int, packed: bool) -> list[list[int]]:
    """The rows of each of `count` micro-batches of equal row counts: padded, consecutive in order of length (the
    least padding); packed, each row (the longest first) into the micro-batch with room and the fewest tokens."""
    rows = len(row_lengths) // count
    longest_first = sorted(range(len(row_lengths)), key=lambda row: -row_lengths[row])
    if not packed:
        return [longest_first[k * rows : (k + 1) * rows] for k in range(count)]
    chosen: list[list[int]] = [[] for _ in range(count)]
    tokens = [0] * count
    for row in longest_first:
        k = min((k for k in range(count) if len(chosen[k]) < rows), key=lambda k: tokens[k])
        chosen[k].append(row)
        tokens[k] += row_lengths[row]
    return chosen


def lengths(batch: dict) -> torch.Tensor:
    """Each row's prompt and completion tokens."""
    return batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)


def _concatenated(values: list, rows: int):
    first = values[0]
    if isinstance(first, torch.Tensor) and first.ndim > 0 and len(first) == rows:
        return torch.cat(values)
    return first  # the same for every micro-batch (num_items_in_batch: the generation batch's tokens) or None


def _rows(value, index: torch.Tensor):
    return value[index.to(value.device)] if isinstance(value, torch.Tensor) and value.ndim > 0 else value


def _trimmed(batch: dict) -> dict:
    """The micro-batch without the columns that are padding in every row: prompts are padded on the left,
    completions on the right (at least one completion column stays)."""
    prompt_used = batch["prompt_mask"].any(0).nonzero()
    first = int(prompt_used[0]) if len(prompt_used) else batch["prompt_mask"].size(1)
    completion_used = batch["completion_mask"].any(0).nonzero()
    width = batch["completion_ids"].size(1)
    end = max(int(completion_used[-1]) + 1 if len(completion_used) else 0, 1)
    trimmed = {}
    for key, value in batch.items():
        if key in PROMPT_KEYS:
            value = value[:, first:]
        elif isinstance(value, torch.Tensor) and value.ndim == 2 and value.size(1) == width:
            value = value[:, :end]
        trimmed[key] = value
    return trimmed
