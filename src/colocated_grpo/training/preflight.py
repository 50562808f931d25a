"""What the runner checks once the config is valid, before W&B starts or the model loads: the dataset as loaded,
every prompt's length in tokens, and TRL's own rules on the trainer settings; all problems at once, as a ConfigError.
What depends on memory is chosen here too (memory_plan)."""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from colocated_grpo.training import config, data, memory_plan, models, prompt_lengths, rewards

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prepared:
    args: object  # trl.GRPOConfig
    dataset: object  # datasets.Dataset
    prompts: dict | None  # prompt_lengths.PromptReport as a dict, for run.json
    memory: dict | None = None  # the memory plan's estimate, for run.json (memory_plan.Plan.record)


def prepare(cfg: DictConfig, run_dir: Path, report_to: list[str]) -> Prepared:
    problems: list[str] = []
    needs = rewards.columns_needed(cfg.reward.weights)
    dataset = report = None
    derived: dict = {}
    plan = None
    try:
        dataset = data.build(cfg.data, needs)
    except data.DataError as err:
        problems += err.problems
    if dataset is not None:
        dataset, report, found = _fit_prompts(cfg, dataset, derived)
        problems += found
        if not found:
            plan = memory_plan.choose(cfg, report.longest_tokens if report else None)
            derived.update(plan.chosen)
            if plan.line:
                log.info("%s", plan.line)
    try:
        args = config.grpo_config(cfg, output_dir=str(run_dir), report_to=report_to, derived=derived)
    except config.ConfigError as err:
        problems += err.problems
    if dataset is not None and not problems:
        problems += _too_few_prompts(cfg, len(dataset), args)
    if not problems:  # it reads the model's files: a model that could not be resolved above is already listed
        problems += offload_beyond_host_memory(cfg)
    if problems:
        raise config.ConfigError(problems)
    prompts = {**dataclasses.asdict(report), **({"derived": derived} if derived else {})} if report else None
    return Prepared(args, dataset, prompts, plan and plan.record)


def _fit_prompts(cfg: DictConfig, dataset, derived: dict):
    """Measure (and drop or truncate) the prompts; where unset, derive vllm_max_model_length: the longest prompt kept
    plus max_completion_length, within the model's context."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(models.resolve(cfg.model))
    except Exception as exc:
        return dataset, None, [f"model.name_or_path={cfg.model.name_or_path!r}: cannot load its tokenizer ({exc})"]
    trainer = cfg.trainer
    arch = models.architecture(cfg.model)
    context = arch.max_position_embeddings if arch else None
    problems = []
    if arch and arch.vocab_size and len(tokenizer) > arch.vocab_size:
        problems.append(
            f"model.name_or_path={cfg.model.name_or_path!r}: its tokenizer has {len(tokenizer)} tokens but the model "
            f"only {arch.vocab_size} embeddings (vocab_size, {arch.source}); use the tokenizer saved with the model"
        )
    use_vllm = config.trainer_value(trainer, "use_vllm")
    engine = config.trainer_value(trainer, "vllm_max_model_length") if use_vllm else None
    completion = int(config.trainer_value(trainer, "max_completion_length"))
    max_prompt = OmegaConf.select(cfg, "data.max_prompt_tokens")
    limit = prompt_lengths.prompt_limit(max_prompt, engine, completion, context)
    policy = cfg.data.get("overlong_prompts", "fail")
    dataset, report, found = prompt_lengths.fit(dataset, tokenizer, *limit, policy)
    problems += found
    if use_vllm and engine is None and not found:
        longest = min(report.longest_tokens, report.limit_tokens or report.longest_tokens)
        derived["vllm_max_model_length"] = min(longest + completion, context or longest + completion)
    return dataset, report, problems


def _too_few_prompts(cfg: DictConfig, rows: int, args) -> list[str]:
    """TRL's sampler drops an incomplete generation batch: fewer distinct prompts than one batch train no step."""
    needed = args.generation_batch_size // args.num_generations
    if rows >= needed:
        return []
    processes = args.world_size
    fixes = [f"a dataset of at least {needed} rows"]
    if cfg.data.get("num_samples") is not None and cfg.data.source == "arithmetic":
        fixes = [f"data.num_samples={needed} or more"]
    elif cfg.data.get("num_samples") is not None:
        fixes.append("data.num_samples=null (every row)")
    if (largest := rows * args.num_generations // (processes * args.steps_per_generation)) >= 1:
        fixes.append(f"trainer.per_device_train_batch_size={largest} or less")
    return [
        f"data: the dataset holds {rows} prompt(s), but one step needs {needed} distinct prompts "
        f"(trainer.per_device_train_batch_size={args.per_device_train_batch_size} x {processes} process(es) x "
        f"steps_per_generation {args.steps_per_generation} / trainer.num_generations={args.num_generations}), so "
        f"no step would train; use {' or '.join(fixes)}"
    ]


# CPU memory per parameter that ZeRO-Offload needs, at least: it keeps 16 bytes (fp32 weights, fp32 gradients, Adam's
# two fp32 moments) and its set-up copies beside them. Measured floor: a 7.6e9-parameter run was killed (SIGKILL) on
# an H200 host with at most 125 GiB available, > 17.6 bytes per parameter; at 16 this check had let that run start.
OFFLOADED_BYTES_PER_PARAMETER = 18


def offload_beyond_host_memory(cfg: DictConfig, available: int | None = None) -> list[str]:
    """The refusal of an optimizer offloaded to CPU memory that this node cannot hold (`available` bytes, by default
    what the OS says): the kernel's out-of-memory killer would end the run with SIGKILL while DeepSpeed sets up."""
    if OmegaConf.select(cfg, "trainer.deepspeed.zero_optimization.offload_optimizer.device") != "cpu":
        return []
    params = models.parameter_count(models.resolve(cfg.model))
    if params is None:
        return []
    import psutil

    world = int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # the state is sharded over every rank of every node
    need = OFFLOADED_BYTES_PER_PARAMETER * params * local / world
    available = psutil.virtual_memory().available if available is None else available
    if need <= available:
        return []
    return [
        f"parallelism={cfg.parallelism.name} needs at least {OFFLOADED_BYTES_PER_PARAMETER} bytes per parameter of "
        "CPU memory (fp32 weights and gradients, Adam's two moments, and DeepSpeed's set-up copies), sharded over the "
        f"ranks: this node's {local} of {world} ranks need ~{need / 2**30:.0f} GiB for {params / 1e9:.2f}e9 "
        f"parameters, but {available / 2**30:.0f} GiB are available, and the kernel would kill the run (SIGKILL) "
        "while DeepSpeed sets up. Spread it over more nodes, use peft=lora, or keep the optimizer on the GPU "
        "(parallelism=zero3, or parallelism=ddp with placement=colocate_sleep) where the GPU holds it"
    ]
