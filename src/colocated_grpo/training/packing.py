"""Packed micro-batches: the sequences of a micro-batch concatenated into one row without padding, each with its own
positions, attended to through a variable-length kernel that keeps them apart. TRL pads each micro-batch to its
longest sequence (prompts on the left, completions on the right); packed, the forward computes no padding token.

The seams with transformers (5.17, on CPU and GPU alike): an attention function registered in its AttentionInterface
under ATTENTION, which the model's attention layers call with the extra keyword arguments of the model's forward
(here `cu_seq_lens` and `max_length`); with no mask function registered under that name, transformers builds no mask.
The model's config names ATTENTION only while a packed forward runs (`attention_of`), so that transformers builds no
mask then. Gradient checkpointing recomputes each layer in the backward, after that forward: so the model's own
attention is replaced for good (`make_packable`) by one that dispatches on what the call carries, the packed kernel
where the call holds the sequences' boundaries, the model's own attention (and its masks) otherwise. On CUDA the
kernel is PyTorch's own `torch.nn.attention.varlen.varlen_attn` (FlashAttention 2 inside PyTorch, from 2.10, with its
backward); on CPU, where PyTorch has no varlen kernel, the same arithmetic one sequence at a time through SDPA."""

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


# + the model's own attention: the dispatcher of make_packable (no "|", which transformers reads as a kernel's prefix)
PACKABLE = "colocated_grpo_packable_"


def varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A causal attention over packed sequences for transformers' AttentionInterface. `query` is (1, heads, tokens,
    head_dim), `key` and `value` (1, kv_heads, tokens, head_dim); returns (1, tokens, heads, head_dim). A sliding window
    (`sliding_window`: each token sees itself and the window's other tokens before it) is kept."""
    if unsupported := [name for name in ("s_aux", "softcap") if kwargs.get(name) is not None]:
        raise NotImplementedError(f"packed micro-batches: the packed attention does not compute {unsupported}")
    boundaries, longest, window = kwargs["cu_seq_lens"], kwargs["max_length"], kwargs.get("sliding_window")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (tokens, heads, head_dim)
    if varlen_kernel_runs(query.is_cuda, query.dtype):
        from torch.nn.attention.varlen import varlen_attn

        groups = query.shape[1] // key.shape[1]
        if groups > 1:  # grouped-query attention: varlen_attn takes as many kv heads as query heads
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
        left = -1 if window is None else window - 1
        out = varlen_attn(q, k, v, boundaries, boundaries, longest, longest, scale=scaling, window_size=(left, 0))
    else:
        out = torch.cat(
            [
                _causal_sdpa(q[start:end], k[start:end], v[start:end], scaling, window)
                for start, end in zip(boundaries[:-1].tolist(), boundaries[1:].tolist(), strict=True)
            ]
        )
    return out.unsqueeze(0), None


def _causal_sdpa(q, k, v, scaling, window: int | None) -> torch.Tensor:
    """One sequence's causal attention, (tokens, heads, head_dim) in and out; grouped-query attention by SDPA itself."""
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    gqa = q.shape[0] != k.shape[0]
    if window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
    else:
        tokens = q.shape[1]
        seen = torch.ones(tokens, tokens, dtype=torch.bool, device=q.device).tril().triu(-(window - 1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=seen, scale=scaling, enable_gqa=gqa)
    return out.transpose(0, 1)


def why_not_packable(model) -> str | None:
    """None where a packed forward computes what the model's own does; else why not, in words."""
    config = model.config
    own = config._attn_implementation
    if own.startswith(PACKABLE):
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if own not in ALL_ATTENTION_FUNCTIONS or own not in ALL_MASK_ATTENTION_FUNCTIONS:
        return f"its attention is {own!r}, which packing cannot stand beside: use sdpa or flash_attention_2"
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "its attention soft-caps its logits, which the packed attention does not"
    if any(hasattr(module, "sinks") for module in model.modules()):
        return "its attention has sinks, which the packed attention does not compute"
    if getattr(config, "attention_dropout", 0.0):
        return "its attention has dropout, which the packed attention does not apply"
    return None


def make_packable(config) -> None:
    """From now on the attention layers of the model of `config` call the packed kernel when the call carries the
    sequences' boundaries (`cu_seq_lens`), and the model's own attention and masks otherwise, whatever its config names
    at the time: checkpointing's recompute of a packed layer, in the backward, is packed too. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTENTION, varlen_attention)
    own = config._attn_implementation
    if own.startswith(PACKABLE):
        return
    own_attention = ALL_ATTENTION_FUNCTIONS[own]

    def packed_or_own(module, query, key, value, attention_mask, **kwargs):
        if "cu_seq_lens" in kwargs:
            return varlen_attention(module, query, key, value, attention_mask, **kwargs)
        return own_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(PACKABLE + own, packed_or_own)
    AttentionMaskInterface.register(PACKABLE + own, ALL_MASK_ATTENTION_FUNCTIONS[own])
    config._attn_implementation = PACKABLE + own


def kernel(dtype: torch.dtype) -> str:
    """Which kernel packed attention runs on this machine for a model of `dtype`, in words."""
    if varlen_kernel_runs(torch.cuda.is_available(), dtype):
        return "PyTorch's varlen_attn, FlashAttention 2"
    if torch.cuda.is_available():
        return f"SDPA one sequence at a time: FlashAttention takes float16 and bfloat16, the model is {dtype}"
    return "SDPA one sequence at a time: no variable-length kernel on CPU"


def varlen_kernel_runs(on_cuda: bool, dtype: torch.dtype) -> bool:
    """PyTorch's varlen_attn runs FlashAttention 2: on CUDA, in float16 or bfloat16 only (a float32 model raised
    "FlashAttention only support fp16 and bf16 data type" in its first packed forward)."""
    return on_cuda and dtype in (torch.float16, torch.bfloat16)


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
    padded forward returns them, from one packed forward of the micro-batch; `config`, the unwrapped model's (made
    packable here, where it was not yet)."""
    make_packable(config)
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
