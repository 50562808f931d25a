"""Settings that depend on memory, chosen before the model loads (`run.auto_memory`): gradient checkpointing is
turned off where one micro-batch's training activations fit on the device beside the engine's share. TRL turns it on
by default; recomputing every layer's forward in the backward costs about a fifth of the train phase
(docs/results.md). A `trainer.gradient_checkpointing` the user sets always wins.

The plan counts what TRL 1.16 holds on one device: the training state, one micro-batch's activations, one tile of the
chunked LM head (TRL never materializes the completion logits), the reference model where `beta > 0`, DDP's gradient
buckets and ZeRO-3 / FSDP's gathered parameters and buckets. Its estimate goes to run.json (`memory_plan`), where the
run's measured peak joins it at the end (`with_peak`), so that every run checks the estimate."""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from colocated_grpo import run_files
from colocated_grpo.training import config, models

GIB = 2**30
# Bytes one token keeps per decoder layer for the backward, in units of the weights' dtype size, per hidden, MLP and
# key/value channel: the norms' float32 copies, q, k and v around RoPE and attention, attention's output, the MLP's
# gate, activation, up and product (a Qwen2 / Llama layer with PyTorch's SDPA attention).
PER_HIDDEN, PER_INTERMEDIATE, PER_KV = 13, 4, 4
# TRL 1.16's chunked LM head (trl/kernels/chunked_logprob.py, called by add_fused_lm_head in trl/trainer/utils.py):
# the log-probs come from [TOKEN_CHUNK_SIZE, VOCAB_CHUNK_SIZE] tiles of logits, one at a time, the same in the
# backward, which recomputes each tile and accumulates the hidden states' and the head's gradients in float32.
HEAD_TOKEN_TILE, HEAD_VOCAB_TILE = 4096, 32768
# DeepSpeed ZeRO-3's buckets, in parameters, where zero_optimization leaves them unset; `auto` (transformers): from
# the hidden size.
ZERO3_BUCKETS = {"stage3_prefetch_bucket_size": (5e7, 0.9), "reduce_bucket_size": (5e8, 1.0)}  # default, x hidden²
USABLE = 0.9  # of the budget: the allocator's fragmentation and transient tensors need the rest
RESERVED = 1 * GIB  # the CUDA context and communication buffers


@dataclass(frozen=True)
class Need:
    """What training holds on one device, in bytes, term by term (`terms`), for a micro-batch of `micro_batch`
    sequences of up to `sequence` tokens."""

    state: float  # weights, gradients and optimizer state
    activations: float  # one micro-batch's, kept for the backward without checkpointing
    checkpointed: float  # the same with checkpointing: each layer's input, and one layer's activations recomputed
    lm_head: float  # one tile of the chunked LM head's logits, and its float32 gradient buffers
    reference: float  # the reference model's weights (beta > 0 without adapters)
    ddp_buckets: float  # DDP's flat copy of the gradients (more than one process)
    sharding: float  # ZeRO-3 / FSDP: parameters gathered for the layer in use and those prefetched, gradient buckets
    micro_batch: int
    sequence: int

    def terms(self, checkpointing: bool) -> dict[str, float]:
        return {
            "weights_gradients_optimizer": self.state,
            "activations": self.checkpointed if checkpointing else self.activations,
            "lm_head_chunk": self.lm_head,
            "reference_model": self.reference,
            "ddp_buckets": self.ddp_buckets,
            "sharding_buffers": self.sharding,
        }

    def total(self, checkpointing: bool) -> float:
        return sum(self.terms(checkpointing).values())

    @property
    def without_checkpointing(self) -> float:
        return self.total(checkpointing=False)


@dataclass(frozen=True)
class Budget:
    """Memory training may take on one device, in bytes: what is free now (the GPU's free memory, so that other
    processes count; on CPU the host's available memory) less what the colocated engine will take of it."""

    free: float
    engine: float  # vLLM's share of the GPU (none with sleep mode, which hands it to training), or its CPU KV cache
    where: str  # how the start line says where the budget comes from
    device: str  # "gpu" or "host"

    @property
    def bytes(self) -> float:
        return max(self.free - self.engine, 0.0)


@dataclass(frozen=True)
class Plan:
    chosen: dict  # GRPOConfig fields to apply where unset
    line: str | None  # the start line
    record: dict | None  # run.json's `memory_plan` (None: no plan)


def choose(cfg: DictConfig, longest_prompt: int | None) -> Plan:
    """The trainer values chosen for this run (GRPOConfig fields, applied where unset), the start line that says why
    and the estimate for run.json; nothing chosen for a `trainer.gradient_checkpointing` given (its line says it is in
    force, with the estimate), and no plan at all with `run.auto_memory` off."""
    given = bool(cfg.trainer.gradient_checkpointing) if "gradient_checkpointing" in cfg.trainer else None
    if given is None and not cfg.run.get("auto_memory"):
        return Plan({}, None, None)
    if (path := models.local_config_json(cfg.model)) is None:
        if given is not None:
            return Plan({}, _given_line(given), None)
        keep = "gradient checkpointing: on (TRL's default): the model's config.json is not on this machine"
        return Plan({"gradient_checkpointing": True}, keep, None)
    need = training_need(cfg, models.config_keys(path), longest_prompt)
    budget = budget_bytes(cfg)
    room = budget.bytes * USABLE - RESERVED
    if given is not None:
        estimate = need.total(given)
        line = (
            f"{_given_line(given)}; training estimated at ~{estimate / GIB:.1f} GiB with it "
            f"({room / GIB:.1f} GiB usable of {budget.bytes / GIB:.1f} {budget.where})"
        )
        return Plan({}, line, _record(need, budget, given, "trainer.gradient_checkpointing"))
    off = need.without_checkpointing <= room
    line = (
        f"gradient checkpointing: {'off' if off else 'on'} (chosen: micro-batches of {need.micro_batch} x "
        f"{need.sequence} tokens train in ~{need.without_checkpointing / GIB:.1f} GiB without it, of which activations "
        f"{need.activations / GIB:.1f}; {room / GIB:.1f} GiB usable of {budget.bytes / GIB:.1f} {budget.where}); "
        f"trainer.gradient_checkpointing={'true' if off else 'false'} overrides"
    )
    return Plan({"gradient_checkpointing": not off}, line, _record(need, budget, not off, "run.auto_memory"))


def _given_line(given: bool) -> str:
    return (
        f"gradient checkpointing: {'on' if given else 'off'} (given: trainer.gradient_checkpointing="
        f"{str(given).lower()}; run.auto_memory chooses only where it is unset)"
    )


def _record(need: Need, budget: Budget, checkpointing: bool, decided_by: str) -> dict:
    """run.json's `memory_plan`, in GiB: the estimate for the checkpointing in force, term by term, and the budget."""

    def gib(value: float) -> float:
        return round(value / GIB, 3)

    return {
        "gradient_checkpointing": checkpointing,
        "decided_by": decided_by,
        "estimate_gib": gib(need.total(checkpointing)),
        "terms_gib": {name: gib(value) for name, value in need.terms(checkpointing).items()},
        "without_checkpointing_gib": gib(need.without_checkpointing),
        "micro_batch": need.micro_batch,
        "sequence_tokens": need.sequence,
        "device": budget.device,
        "free_gib": gib(budget.free),
        "engine_gib": gib(budget.engine),
        "budget_gib": gib(budget.bytes),
        "usable_gib": gib(budget.bytes * USABLE - RESERVED),
    }


def training_need(cfg: DictConfig, model_config: dict, longest_prompt: int | None) -> Need:
    """Bytes training holds on one device for `cfg`'s model (its config.json's keys) and micro-batch."""
    hidden, layers = int(model_config["hidden_size"]), int(model_config["num_hidden_layers"])
    intermediate = int(model_config.get("intermediate_size") or 4 * hidden)
    heads = int(model_config["num_attention_heads"])
    kv = int(model_config.get("num_key_value_heads") or heads) * int(model_config.get("head_dim") or hidden // heads)
    vocab = int(model_config.get("vocab_size") or 0)
    tied = bool(model_config.get("tie_word_embeddings", True))  # transformers' default
    dtype = str(cfg.model.get("dtype", "auto"))
    if dtype == "auto":
        dtype = str(model_config.get("torch_dtype") or model_config.get("dtype") or "float32")
    size = 2 if dtype in ("bfloat16", "float16") else 4
    params = models.parameter_count(models.resolve(cfg.model)) or _parameters(
        hidden, intermediate, layers, kv, vocab, tied
    )
    layer_params = _parameters(hidden, intermediate, 1, kv, 0)

    world = int(os.environ.get("WORLD_SIZE") or cfg.parallelism.get("nproc_per_node") or 1)
    parallelism = str(cfg.parallelism.name)
    sharded = parallelism.startswith("zero3") or parallelism == "fsdp"
    adapters = config.peft_name(cfg) != "none"
    if adapters:
        state = params * size / (world if sharded else 1)  # frozen weights; adapters small
    elif parallelism == "zero3_offload":
        state = params * 2 * size / world  # weights and gradients; the optimizer state in CPU memory
    elif sharded:
        state = params * 16 / world  # float32 master weights, gradients and AdamW's two moments, sharded
    else:
        state = params * 4 * size  # weights, gradients and AdamW's two moments in the weights' dtype

    trainer = cfg.trainer
    micro_batch = int(config.trainer_value(trainer, "per_device_train_batch_size"))
    completion = int(config.trainer_value(trainer, "max_completion_length"))
    # the longest training sequence: the longest prompt plus a whole completion (without the prompts, the engine's
    # context where it is set)
    engine = trainer.get("vllm_max_model_length")
    sequence = int(engine) if longest_prompt is None and engine is not None else (longest_prompt or 0) + completion
    tokens = micro_batch * sequence
    per_token_layer = size * (PER_HIDDEN * hidden + PER_INTERMEDIATE * intermediate + PER_KV * kv)
    activations = tokens * layers * per_token_layer
    checkpointed = tokens * (layers * hidden * size + per_token_layer)

    # The chunked LM head: one tile of logits, in float32 where trainer.cast_lm_head_to_fp32 asks, and the backward's
    # float32 gradients of the hidden states it scores and, where the head trains, of its weight. On GPUs (Triton) it
    # scores the completion tokens only; elsewhere every position.
    scored = micro_batch * (completion if _triton_device() else sequence)
    tile_bytes = 4 if config.trainer_value(trainer, "cast_lm_head_to_fp32") else size
    lm_head = min(scored, HEAD_TOKEN_TILE) * min(vocab, HEAD_VOCAB_TILE) * tile_bytes + scored * hidden * 4
    if not adapters:
        lm_head += vocab * hidden * 4

    # TRL loads a reference model for beta > 0, in the weights' dtype, sharded as the policy is; with adapters it
    # disables them instead (no copy)
    reference = 0.0
    if float(config.trainer_value(trainer, "beta")) != 0.0 and not adapters:
        reference = params * size / (world if sharded else 1)

    # DDP's reducer keeps its own flat buckets of the gradients (transformers and accelerate leave
    # gradient_as_bucket_view off): one more gradient set in the weights' dtype; adapters' gradients are small
    ddp_buckets = params * size if parallelism == "ddp" and world > 1 and not adapters else 0.0

    sharding = 0.0
    if parallelism.startswith("zero3"):
        # ZeRO-3: the parameters of the module in use gathered whole (the largest: a decoder layer, or the embedding
        # that the LM head's tiles gather), the prefetch bucket gathered ahead of it, the gradient reduce bucket
        zero = OmegaConf.select(cfg, "trainer.deepspeed.zero_optimization") or {}
        buckets = sum(_zero3_bucket(zero.get(key), *default, hidden) for key, default in ZERO3_BUCKETS.items())
        sharding = (max(layer_params, vocab * hidden) + buckets) * size
    elif parallelism == "fsdp":
        # FSDP2: the layer in use and the next one (prefetched) gathered, one layer's unsharded gradients before their
        # reduce-scatter, and the root module's parameters (embedding, LM head) gathered for the whole step
        sharding = (3 * layer_params + vocab * hidden * (1 if tied else 2)) * size

    return Need(state, activations, checkpointed, lm_head, reference, ddp_buckets, sharding, micro_batch, sequence)


def _zero3_bucket(value, default: float, per_hidden_squared: float, hidden: int) -> float:
    """A ZeRO-3 bucket's size in parameters: as set, `auto` from the hidden size, else DeepSpeed's default."""
    if value is None:
        return default
    return per_hidden_squared * hidden * hidden if value == "auto" else float(value)


def _triton_device() -> bool:
    """Whether TRL's chunked head runs its Triton kernel here (a GPU), which scores only the completion tokens."""
    import torch

    return torch.cuda.is_available()


def _parameters(hidden: int, intermediate: int, layers: int, kv: int, vocab: int, tied: bool = True) -> int:
    """A decoder's parameters from its shape (attention, MLP, the embedding, and an LM head of its own where the
    embeddings are not tied): where no weight files say it."""
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * intermediate) + embeddings


def budget_bytes(cfg: DictConfig) -> Budget:
    """Memory training may take on one device: the GPU's free memory less the colocated engine's share of the GPU
    (none with sleep mode, which hands the share to training), or this host's available memory less the KV cache."""
    import torch

    trainer = cfg.trainer
    colocated = trainer.get("use_vllm") and trainer.get("vllm_mode") == "colocate"
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", 0)))
        used = f" ({(total - free) / GIB:.1f} GiB held by other processes)" if total - free > RESERVED else ""
        if colocated and not trainer.get("vllm_enable_sleep_mode"):
            share = float(trainer.get("vllm_gpu_memory_utilization"))
            return Budget(free, share * total, f"GiB free on the GPU{used} beside vLLM's {share:g} share", "gpu")
        return Budget(free, 0.0, f"GiB free on the GPU{used}", "gpu")
    import psutil

    available = psutil.virtual_memory().available
    if colocated:
        kv_cache = float(cfg.run.cpu_kvcache_gb) * GIB
        return Budget(available, kv_cache, "GiB of host memory available beside vLLM's KV cache", "host")
    return Budget(available, 0.0, "GiB of host memory available", "host")


def with_peak(record: dict | None, run_dir, from_step: int) -> dict | None:
    """run.json's `memory_plan` with the most the device held in this attempt beside the estimate: on a GPU the
    highest `memory/peak_gb` of the attempt's steps (NVML: the whole GPU, the engine's share and other processes
    included), else this process's peak resident memory (the engine, its KV cache and the libraries included)."""
    if record is None:
        return None
    import torch

    if torch.cuda.is_available():
        rows = run_files.read_jsonl(run_dir / run_files.METRICS)
        peaks = [
            r["memory/peak_gb"] for r in rows if r.get(run_files.STEP_KEY, 0) > from_step and "memory/peak_gb" in r
        ]
        if peaks:
            return {**record, "peak_gib": round(max(peaks) * 1e9 / GIB, 3), "peak_of": "gpu (NVML)"}
        peak = torch.cuda.max_memory_reserved(int(os.environ.get("LOCAL_RANK", 0)))
        return {**record, "peak_gib": round(peak / GIB, 3), "peak_of": "gpu (PyTorch's allocator, reserved)"}
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {**record, "peak_gib": round(peak / GIB, 3), "peak_of": "host (this process's peak resident memory)"}
