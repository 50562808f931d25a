"""What the model needs to know of a model's shape: parameters (weights to train, sync and read each decoding step)
and KV-cache bytes per token (what a longer context costs each decoding step, and what fits in a memory share)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    params_b: float  # parameters, 1e9
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


# Qwen2.5 (config.json of each model; the conf/model *-random presets build these shapes).
SHAPES = {
    "qwen2.5-0.5b": Shape(0.494, 24, 2, 64),
    "qwen2.5-1.5b": Shape(1.544, 28, 2, 128),
    "qwen2.5-7b": Shape(7.616, 28, 4, 128),
}


def shape_for(params_b: float) -> Shape:
    """The known shape of that size (within 5 %), else the nearest known shape scaled to it."""
    nearest = min(SHAPES.values(), key=lambda s: abs(s.params_b - params_b))
    if abs(nearest.params_b - params_b) <= 0.05 * params_b:
        return nearest
    scale = params_b / nearest.params_b
    return Shape(params_b, max(1, round(nearest.layers * scale**0.5)), nearest.kv_heads, nearest.head_dim)
