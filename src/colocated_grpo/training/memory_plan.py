"""Settings that depend on memory, chosen before the model loads (`run.auto_memory`): gradient checkpointing is
turned off where one micro-batch's training activations fit on the device beside the engine's share. TRL turns it on
by default; recomputing every layer's forward in the backward costs about a fifth of the train phase
(docs/results.md). A `trainer.gradient_checkpointing` the user sets always wins."""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import DictConfig

from colocated_grpo.training import config, models

GIB = 2**30
# Bytes one token keeps per decoder layer for the backward, in units of the weights' dtype size, per hidden, MLP and
# key/value channel: the norms' float32 copies, q, k and v around RoPE and attention, attention's output, the MLP's
# gate, activation, up and product (a Qwen2 / Llama layer with PyTorch's SDPA attention).
PER_HIDDEN, PER_INTERMEDIATE, PER_KV = 13, 4, 4
LOGIT_BYTES = 4  # per completion token and vocabulary entry: the logits and their log-softmax, kept for the backward
USABLE = 0.9  # of the budget: the allocator's fragmentation and transient tensors need the rest
RESERVED = 1 * GIB  # the CUDA context and communication buffers


@dataclass(frozen=True)
class Need:
    """What training holds on one device, in bytes: weights, gradients and optimizer state; activations of one
    micro-batch without checkpointing; the completion logits."""

    state: float
    activations: float
    logits: float
    micro_batch: int
    sequence: int  # tokens of the longest sequence in it

    @property
    def without_checkpointing(self) -> float:
        return self.state + self.activations + self.logits


def choose(cfg: DictConfig, longest_prompt: int | None) -> tuple[dict, str | None]:
    """The trainer values chosen for this run (GRPOConfig fields, applied where unset) and the start line that says
    why; nothing chosen, and a line that says so, for a `trainer.gradient_checkpointing` given; ({}, None) with
    `run.auto_memory` off."""
    if "gradient_checkpointing" in cfg.trainer:
        given = bool(cfg.trainer.gradient_checkpointing)
        return {}, (
            f"gradient checkpointing: {'on' if given else 'off'} (given: trainer.gradient_checkpointing="
            f"{str(given).lower()}; run.auto_memory chooses only where it is unset)"
        )
    if not cfg.run.get("auto_memory"):
        return {}, None
    keep = "gradient checkpointing: on (TRL's default)"
    if (path := models.local_config_json(cfg.model)) is None:
        return {"gradient_checkpointing": True}, f"{keep}: the model's config.json is not on this machine"
    need = training_need(cfg, models.config_keys(path), longest_prompt)
    budget, where = budget_bytes(cfg)
    room = budget * USABLE - RESERVED
    off = need.without_checkpointing <= room
    line = (
        f"gradient checkpointing: {'off' if off else 'on'} (chosen: micro-batches of {need.micro_batch} x "
        f"{need.sequence} tokens train in ~{need.without_checkpointing / GIB:.1f} GiB without it, of which activations "
        f"{need.activations / GIB:.1f}; {room / GIB:.1f} GiB usable of {budget / GIB:.1f} {where}); "
        f"trainer.gradient_checkpointing={'true' if off else 'false'} overrides"
    )
    return {"gradient_checkpointing": not off}, line


def training_need(cfg: DictConfig, model_config: dict, longest_prompt: int | None) -> Need:
    """Bytes training holds on one device for `cfg`'s model (its config.json's keys) and micro-batch."""
    hidden, layers = int(model_config["hidden_size"]), int(model_config["num_hidden_layers"])
    intermediate = int(model_config.get("intermediate_size") or 4 * hidden)
    heads = int(model_config["num_attention_heads"])
    kv = int(model_config.get("num_key_value_heads") or heads) * int(model_config.get("head_dim") or hidden // heads)
    vocab = int(model_config.get("vocab_size") or 0)
    dtype = str(cfg.model.get("dtype", "auto"))
    if dtype == "auto":
        dtype = str(model_config.get("torch_dtype") or model_config.get("dtype") or "float32")
    size = 2 if dtype in ("bfloat16", "float16") else 4
    params = models.parameter_count(models.resolve(cfg.model)) or _parameters(hidden, intermediate, layers, kv, vocab)

    world = int(os.environ.get("WORLD_SIZE") or cfg.parallelism.get("nproc_per_node") or 1)
    parallelism = str(cfg.parallelism.name)
    if config.peft_name(cfg) != "none":
        state = params * size / (world if parallelism.startswith("zero3") else 1)  # frozen weights; adapters small
    elif parallelism == "zero3_offload":
        state = params * 2 * size / world  # weights and gradients; the optimizer state in CPU memory
    elif parallelism in ("zero3", "fsdp"):
        state = params * 16 / world  # float32 master weights, gradients and AdamW's two moments, sharded
    else:
        state = params * 4 * size  # weights, gradients and AdamW's two moments in the weights' dtype

    micro_batch = int(config.trainer_value(cfg.trainer, "per_device_train_batch_size"))
    completion = int(config.trainer_value(cfg.trainer, "max_completion_length"))
    # the longest training sequence: the longest prompt plus a whole completion (without the prompts, the engine's
    # context where it is set)
    engine = cfg.trainer.get("vllm_max_model_length")
    sequence = int(engine) if longest_prompt is None and engine is not None else (longest_prompt or 0) + completion
    per_token_layer = size * (PER_HIDDEN * hidden + PER_INTERMEDIATE * intermediate + PER_KV * kv)
    activations = micro_batch * sequence * layers * per_token_layer
    return Need(state, activations, micro_batch * completion * vocab * LOGIT_BYTES, micro_batch, sequence)


def _parameters(hidden: int, intermediate: int, layers: int, kv: int, vocab: int) -> int:
    """A decoder's parameters from its shape (attention, MLP, embeddings): where no weight files say it."""
    return layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate) + vocab * hidden


def budget_bytes(cfg: DictConfig) -> tuple[float, str]:
    """Memory training may take on one device, and where it comes from: the GPU less the colocated engine's share
    (all of it with sleep mode, which hands the share to training), or this host's available memory on CPU."""
    import torch

    trainer = cfg.trainer
    colocated = trainer.get("use_vllm") and trainer.get("vllm_mode") == "colocate"
    if torch.cuda.is_available():
        device = int(os.environ.get("LOCAL_RANK", 0))
        total = torch.cuda.get_device_properties(device).total_memory
        if colocated and not trainer.get("vllm_enable_sleep_mode"):
            share = float(trainer.get("vllm_gpu_memory_utilization"))
            return total * (1 - share), f"GiB on the GPU beside vLLM's {share:g} share"
        return total, "GiB on the GPU"
    import psutil

    available = psutil.virtual_memory().available
    if colocated:
        available -= float(cfg.run.cpu_kvcache_gb) * GIB
        return available, "GiB of host memory available beside vLLM's KV cache"
    return available, "GiB of host memory available"
