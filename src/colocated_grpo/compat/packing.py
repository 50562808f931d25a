"""Packed micro-batches: the sequences of a micro-batch concatenated into one row without padding, each with its own
positions, attended to through a variable-length kernel that keeps them apart. TRL pads each micro-batch to its
longest sequence (prompts on the left, completions on the right); packed, the forward computes no padding token.

The seams with transformers (5.17 on GPUs, 5.24 on CPU): an attention function registered in its AttentionInterface
under ATTENTION, which the model's attention layers call with the extra keyword arguments of the model's forward
(here `cu_seq_lens` and `max_length`); with no mask function registered under that name, transformers builds no mask.
The model's config names ATTENTION only while a packed forward runs (`attention_of`). On CUDA the kernel is PyTorch's
own `torch.nn.attention.varlen.varlen_attn` (FlashAttention 2 inside PyTorch, from 2.10, with its backward); on CPU,
where PyTorch has no varlen kernel, the same arithmetic one sequence at a time through SDPA."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION = "colocated_grpo_varlen"


@dataclass
class Packed:
    """One micro-batch packed: `input_ids` and `position_ids` of shape (1, tokens); `cu_seq_lens`, the sequences'
    boundaries (0, end of the first, …, tokens); `kept`, where each packed token sat in the padded (rows, length)
    batch."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seq_lens: torch.Tensor
    max_length: int
    kept: torch.Tensor

    @classmethod
    def of(cls, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
        kept = attention_mask.bool()
        lengths = kept.sum(dim=1)
        positions = kept.cumsum(dim=1) - 1  # each sequence counts from 0 over its own tokens
        boundaries = F.pad(lengths.cumsum(dim=0), (1, 0)).to(torch.int32)
        return cls(
            input_ids=input_ids[kept].unsqueeze(0),
            position_ids=positions[kept].unsqueeze(0),
            cu_seq_lens=boundaries,
            max_length=int(lengths.max()),
            kept=kept,
        )

    def unpack(self, per_token: torch.Tensor) -> torch.Tensor:
        """(1, tokens - 1) values of each next token, as a fused LM head returns them, back into the padded layout of
        (rows, length - 1): 0 where the padded batch held padding."""
        rows, length = self.kept.shape
        full = F.pad(per_token[0], (1, 0))  # the value of packed token t: predicted from token t - 1
        padded = full.new_zeros(rows, length)
        padded[self.kept] = full
        return padded[:, 1:]


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A causal attention over packed sequences for transformers' AttentionInterface. `query` is (1, heads, tokens,
    head_dim), `key` and `value` (1, kv_heads, tokens, head_dim); returns (1, tokens, heads, head_dim)."""
    boundaries, longest = kwargs["cu_seq_lens"], kwargs["max_length"]
    groups = query.shape[1] // key.shape[1]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, head_dim)
    if groups > 1:  # grouped-query attention: each kv head serves `groups` query heads
        k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    if query.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        out = varlen_attn(q, k, v, boundaries, boundaries, longest, longest, scale=scaling, window_size=(-1, 0))
    else:
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1),
                    k[start:end].transpose(0, 1),
                    v[start:end].transpose(0, 1),
                    is_causal=True,
                    scale=scaling,
                ).transpose(0, 1)
                for start, end in zip(boundaries[:-1].tolist(), boundaries[1:].tolist(), strict=True)
            ]
        )
    return out.unsqueeze(0), None


def kernel() -> str:
    """Which kernel packed attention runs on this machine, in words."""
    if torch.cuda.is_available():
        return "PyTorch's varlen_attn, FlashAttention 2"
    return "SDPA one sequence at a time: no variable-length kernel on CPU"


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, varlen_attention)


@contextmanager
def attention_of(config, name: str):
    """A model's attention layers call `name` inside the block (its config object serves them all)."""
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def per_token_logps(model, config, input_ids, attention_mask, logits_to_keep: int, compute_entropy: bool):
    """TRL's fused LM head's log-probs (and entropies) of the last `logits_to_keep` tokens of each row, as TRL's
    padded forward returns them, from one packed forward of the micro-batch; `config`, the unwrapped model's."""
    packed = Packed.of(input_ids, attention_mask)
    labels = input_ids.masked_fill(~packed.kept, -100)
    labels[:, :-logits_to_keep] = -100  # only the completion tokens are scored
    with attention_of(config, ATTENTION):
        outputs = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            labels=labels[packed.kept].unsqueeze(0),
            fused_lm_head=True,
            cu_seq_lens=packed.cu_seq_lens,
            max_length=packed.max_length,
        )
    logps = packed.unpack(outputs.log_probs)[:, -logits_to_keep:]
    entropies = packed.unpack(outputs.entropy)[:, -logits_to_keep:] if compute_entropy else None
    return logps, entropies
