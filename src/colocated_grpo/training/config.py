"""Config checks that run before any model is loaded or GPU memory is taken, and the mapping to GRPOConfig."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import typing
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from colocated_grpo.compat.trl import generation_batch_size
from colocated_grpo.resilience.checkpoints import RESUME_MODES
from colocated_grpo.training import data, field_types, lengths, models, rewards
from colocated_grpo.training.models import SHAPES

log = logging.getLogger(__name__)

# Our keys that are not GRPOConfig fields; everything under `trainer` goes to GRPOConfig unchanged.
RUNNER_OWNED = ("output_dir", "report_to", "seed", "reward_weights", "run_name")


class ConfigError(ValueError):
    """One or more invalid settings; the message names each key and how to fix it."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n" + "\n".join(f"  - {p}" for p in problems))


def validate(cfg: DictConfig, world: int | None = None) -> None:
    """Raise ConfigError listing every problem found. Reads no weights, only config.json and local data files."""
    if world is None:  # the processes: torchrun's WORLD_SIZE when launched, else what the sweep launcher will start
        world = int(os.environ.get("WORLD_SIZE") or OmegaConf.select(cfg, "parallelism.nproc_per_node", default=1))
    problems = [f"{k} is not set (???): {MISSING_FIXES.get(k, f'set it with {k}=<value>')}" for k in _missing_keys(cfg)]
    # _trainer_problems reads trainer values as the types they must have: only once they have them
    problems += trainer_field_problems(cfg.trainer) or _trainer_problems(cfg, world)
    problems += _reward_problems(cfg)
    if not OmegaConf.is_missing(cfg.model, "name_or_path"):
        problems += _model_problems(cfg.model)
    if cfg.run.resume not in RESUME_MODES:  # run.* has its types from the schema node; its values are checked here
        problems.append(f"run.resume={cfg.run.resume!r} must be one of {list(RESUME_MODES)}")
    if cfg.placement.get("fast_sync") and not float(cfg.placement.sync_chunk_gb) > 0:
        problems.append(
            f"placement.sync_chunk_gb={cfg.placement.sync_chunk_gb} must be above 0 (GiB of gathered FSDP2 weights "
            "loaded into vLLM at once, e.g. 1.0)"
        )
    problems += backend_problems(cfg)
    problems += placement_switch_problems(cfg) or engine_process_problems(cfg)
    if problems:
        raise ConfigError(problems)


# The placement group's switches: a value Hydra reads as a string ("off", "no") must not turn one on
PLACEMENT_SWITCHES = (
    "engine_process",
    "overlap",
    "fast_outputs",
    "fast_sync",
    "one_forward",
    "cpu_eager",
    "model_runner_v2",
)


def placement_switch_problems(cfg: DictConfig) -> list[str]:
    return [
        f"placement.{key}={value!r} must be true or false"
        for key in PLACEMENT_SWITCHES
        if (value := cfg.placement.get(key)) is not None and not isinstance(value, bool)
    ]


def engine_process_problems(cfg: DictConfig) -> list[str]:
    """placement=colocate_process: one engine per rank in its own process, its weights sent whole by our sync."""
    if not cfg.placement.get("engine_process"):
        return []
    problems = []
    why = "placement=colocate_process runs one engine per rank, in a process of its own"
    if (tp := int(cfg.trainer.get("vllm_tensor_parallel_size") or 1)) != 1:
        problems.append(f"{why}: trainer.vllm_tensor_parallel_size={tp} needs placement=colocate")
    if cfg.parallelism.name != "ddp":
        problems.append(
            f"{why}, its weights sent whole from each rank: parallelism={cfg.parallelism.name} shards them; use "
            "parallelism=ddp or placement=colocate"
        )
    if (adapter := peft_name(cfg)) != "none":
        problems.append(f"{why}: peft={adapter} is not supported there yet; use placement=colocate")
    if cfg.placement.get("overlap") and cfg.trainer.get("vllm_enable_sleep_mode"):
        problems.append(
            "placement.overlap=true generates while training runs, so the engine cannot sleep: set "
            "trainer.vllm_enable_sleep_mode=false"
        )
    if cfg.placement.get("overlap") and cfg.trainer.get("vllm_importance_sampling_correction") is False:
        problems.append(
            "placement.overlap=true trains on batches sampled by the policy of one step before, which TRL's "
            "importance-sampling correction accounts for: set trainer.vllm_importance_sampling_correction=true"
        )
    return problems


# What a mandatory value left as ??? needs, by key; other keys get a generic message.
MISSING_FIXES = {
    "model.name_or_path": "model=local needs the model: model.name_or_path=/path/to/model (a directory with "
    "config.json) or a hub id such as model.name_or_path=Qwen/Qwen2-0.5B-Instruct",
    "data.files": "data=local needs its files: data.files=/path/train.jsonl (or [a.jsonl,b.jsonl]; json, jsonl, "
    "parquet or csv)",
    "data.path": "data=hub needs the dataset: data.path=<hub name, e.g. trl-lib/tldr, or a local directory or file>",
}


def _missing_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for key in node:
        full = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            keys.append(full)
        elif OmegaConf.is_dict(node._get_node(key)) and not full.startswith("hydra"):
            keys += _missing_keys(node[key], full + ".")
    return keys


# GRPOConfig's fields by TRL and transformers version (.ci's pins; tests/scripts/write_grpo_fields.py): reading them
# from GRPOConfig imports torch, transformers and TRL, ~4 s of CPU that a sweep's parent needs for nothing else.
FIELD_TABLES = Path(__file__).with_name("grpo_fields.json")
# The names its types are written in (tests/scripts/write_grpo_fields.py spells them)
TYPE_NAMES = {t.__name__: t for t in (bool, int, float, str, list, tuple, dict)} | {"Any": typing.Any}


@functools.cache
def grpo_fields(from_table: bool = True) -> dict:
    """trl.GRPOConfig's init fields: name -> (annotation, default), from the table of the TRL and transformers
    installed, else (or with from_table=False) from GRPOConfig itself."""
    versions = {name: importlib.metadata.version(name) for name in ("trl", "transformers")}
    for table in json.loads(FIELD_TABLES.read_text()) if from_table else []:
        if table["versions"] == versions:
            return {name: (read_type(text), default) for name, (text, default) in table["fields"].items()}
    from trl import GRPOConfig

    hints = typing.get_type_hints(GRPOConfig)
    return {
        f.name: (hints[f.name], f.default if f.default_factory is dataclasses.MISSING else f.default_factory())
        for f in dataclasses.fields(GRPOConfig)
        if f.init
    }


def read_type(text: str):
    """A type as the field table spells it (`int | None`, `Literal['a', 'b']`, `dict[str, Any]`) read back into the
    annotation it names; anything else is refused."""

    def read(node: ast.expr):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return typing.Union[read(node.left), read(node.right)]  # noqa: UP007 (the operands may be None)
        if isinstance(node, ast.Constant) and node.value is None:
            return None
        if isinstance(node, ast.Name) and node.id in TYPE_NAMES:
            return TYPE_NAMES[node.id]
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if node.value.id == "Literal" and all(isinstance(item, ast.Constant) for item in items):
                return typing.Literal[tuple(item.value for item in items)]
            if node.value.id in ("list", "tuple", "dict"):
                args = tuple(... if isinstance(i, ast.Constant) and i.value is ... else read(i) for i in items)
                return TYPE_NAMES[node.value.id][args]
        raise ValueError(f"{text!r}: not a type the field table spells")

    return read(ast.parse(text, mode="eval").body)


def trainer_field_problems(trainer: DictConfig) -> list[str]:
    """Each `trainer.*` key must be a GRPOConfig field (not one the runner sets) holding a value of the field's type."""
    fields = grpo_fields()
    try:
        values = OmegaConf.to_container(trainer, resolve=True, throw_on_missing=False)
    except Exception as exc:  # an interpolation that does not resolve
        return [f"trainer: cannot resolve its values ({type(exc).__name__}: {exc})"]
    problems = []
    for key, value in values.items():
        if key in RUNNER_OWNED:
            problems.append(f"trainer.{key} is set by the runner; remove it (see run.* / logger.* / seed)")
        elif key not in fields:
            close = difflib.get_close_matches(key, [f for f in fields if f not in RUNNER_OWNED], n=1)
            hint = f"; did you mean trainer.{close[0]}?" if close else ""
            problems.append(
                f"trainer.{key} is not a trl.GRPOConfig field (keys under trainer are TRL's own names{hint})"
            )
        elif not field_types.fits(value, fields[key][0]):
            annotation = fields[key][0]
            problems.append(
                f"trainer.{key}={value!r} must be {field_types.describe(annotation)} "
                f"(the type of trl.GRPOConfig.{key}; its default is {fields[key][1]!r})"
            )
    return problems


def trainer_value(trainer: DictConfig, key: str):
    """`trainer.<key>` as set, else GRPOConfig's default for it."""
    return trainer[key] if key in trainer else grpo_fields()[key][1]


def _trainer_problems(cfg: DictConfig, world: int) -> list[str]:
    trainer = cfg.trainer
    problems: list[str] = []
    if trainer_value(trainer, "use_vllm"):
        mem = trainer_value(trainer, "vllm_gpu_memory_utilization")
        if not 0 < float(mem) < 1:
            problems.append(
                f"trainer.vllm_gpu_memory_utilization={mem} must be strictly between 0 and 1 "
                "(the share of each GPU vLLM may take, e.g. 0.3)"
            )
        if trainer_value(trainer, "vllm_mode") == "colocate":
            tp = int(trainer_value(trainer, "vllm_tensor_parallel_size"))
            if tp < 1 or world % tp:
                problems.append(
                    f"trainer.vllm_tensor_parallel_size={tp} must divide the world size {world} "
                    f"(torchrun --nproc_per_node / parallelism.nproc_per_node); use one of {_divisors(world)}"
                )
            problems += _heads_problems(cfg.model, tp, "trainer.vllm_tensor_parallel_size")
        elif trainer_value(trainer, "vllm_mode") == "server":
            p = cfg.placement
            if not 0 < float(p.gpu_memory_utilization) < 1:
                problems.append(
                    f"placement.gpu_memory_utilization={p.gpu_memory_utilization} must be strictly between 0 and 1"
                )
            problems += _heads_problems(
                cfg.model, int(p.server_tensor_parallel_size), "placement.server_tensor_parallel_size"
            )

    num_gen = int(trainer_value(trainer, "num_generations"))
    batch = generation_batch_size(trainer, world)
    if num_gen < 2:
        problems.append(f"trainer.num_generations={num_gen} must be at least 2 (GRPO compares completions of a prompt)")
    elif batch % num_gen:
        problems.append(
            f"trainer.num_generations={num_gen} must divide the generation batch {batch} "
            f"(per_device_train_batch_size × world size {world} × steps_per_generation); "
            f"use one of {[d for d in _divisors(batch) if d >= 2]} or change the batch"
        )
    max_steps = trainer_value(trainer, "max_steps")
    if max_steps < 1 and max_steps != -1:
        problems.append(
            f"trainer.max_steps={max_steps} must be a positive number of steps, or -1 to train "
            "trainer.num_train_epochs over the dataset"
        )
    if OmegaConf.select(cfg, "telemetry.enabled") and int(trainer_value(trainer, "logging_steps")) != 1:
        problems.append(
            f"trainer.logging_steps={trainer.get('logging_steps')}: telemetry records every step, so it must be 1 "
            "(or turn telemetry off with telemetry=off)"
        )
    if "model_init_kwargs" in trainer and not OmegaConf.is_dict(trainer.model_init_kwargs):
        problems.append(
            f"trainer.model_init_kwargs={trainer.model_init_kwargs!r} must be a mapping of from_pretrained's keyword "
            "arguments (e.g. trainer.model_init_kwargs={attn_implementation:sdpa}), or left out; model.dtype sets "
            "the dtype"
        )
    problems += length_problems(cfg)
    problems += length_profile_problems(cfg)
    return problems


def length_profile_problems(cfg: DictConfig) -> list[str]:
    """run.length_profile: a known profile, for vLLM's request, where completions are not all run to the cap."""
    name = cfg.run.length_profile
    if name is None:
        return []
    if name not in lengths.PROFILES:
        return [f"run.length_profile={name!r} is not a length profile: one of {', '.join(lengths.PROFILES)}, or null"]
    problems = []
    if cfg.run.fixed_completion_length:
        problems.append(
            f"run.length_profile={name} and run.fixed_completion_length=true both set the completions' lengths; "
            "set run.fixed_completion_length=false (every completion to the cap) or run.length_profile=null"
        )
    if not trainer_value(cfg.trainer, "use_vllm"):
        problems.append(
            f"run.length_profile={name} is a request to vLLM; with trainer.use_vllm=false (placement=none) there is "
            "no engine to take it"
        )
    temperature = float(trainer_value(cfg.trainer, "temperature"))
    if temperature != 1.0 and trainer_value(cfg.trainer, "vllm_importance_sampling_correction"):
        problems.append(
            f"run.length_profile={name} with trainer.temperature={temperature:g}: the importance-sampling ratio "
            "would weigh the profile's EOS bias as off-policy sampling (the engine's log-probs are read before the "
            "profile's bias and the temperature, which only a temperature of 1 leaves out of both); set "
            "trainer.temperature=1.0 or trainer.vllm_importance_sampling_correction=false"
        )
    return problems


def length_problems(cfg: DictConfig) -> list[str]:
    """Prompt + completion must fit in the engine's context and the model's (where its config is at hand)."""
    trainer, problems = cfg.trainer, []
    completion = int(trainer_value(trainer, "max_completion_length"))
    prompt = OmegaConf.select(cfg, "data.max_prompt_tokens")
    prompt = prompt if isinstance(prompt, int) and prompt > 0 else None
    engine = trainer_value(trainer, "vllm_max_model_length") if trainer_value(trainer, "use_vllm") else None
    known = not OmegaConf.is_missing(cfg.model, "name_or_path") and not _model_problems(cfg.model)
    arch = models.architecture(cfg.model) if known else None
    context = arch.max_position_embeddings if arch else None
    derive = "set trainer.vllm_max_model_length=null to derive it from the prompts and max_completion_length"
    if engine is not None:
        if completion >= engine:
            problems.append(
                f"trainer.max_completion_length={completion} leaves no room for a prompt in "
                f"trainer.vllm_max_model_length={engine} (prompt + completion tokens); raise vllm_max_model_length, "
                f"lower max_completion_length, or {derive}"
            )
        elif prompt is not None and prompt + completion > engine:
            problems.append(
                f"data.max_prompt_tokens={prompt} + trainer.max_completion_length={completion} = "
                f"{prompt + completion} exceed trainer.vllm_max_model_length={engine}; raise vllm_max_model_length "
                f"to {prompt + completion}, lower one of the two, or {derive}"
            )
        if context is not None and engine > context:
            problems.append(
                f"trainer.vllm_max_model_length={engine} exceeds the model's context of {context} tokens "
                f"(max_position_embeddings, {arch.source}); use at most {context}"
            )
    elif context is not None and (prompt or 1) + completion > context:
        problems.append(
            f"trainer.max_completion_length={completion}"
            + (f" + data.max_prompt_tokens={prompt}" if prompt else " + a prompt")
            + f" exceed the model's context of {context} tokens (max_position_embeddings, {arch.source})"
        )
    return problems


def _reward_problems(cfg: DictConfig) -> list[str]:
    problems = []
    for module in OmegaConf.select(cfg, "reward.modules") or []:
        try:
            rewards.load_modules([module])
        except Exception as exc:
            problems.append(
                f"reward.modules: cannot import {module!r} ({type(exc).__name__}: {exc}); "
                "its directory must be on PYTHONPATH"
            )
    weights = OmegaConf.to_container(OmegaConf.select(cfg, "reward.weights") or OmegaConf.create({}), resolve=True)
    params = OmegaConf.to_container(OmegaConf.select(cfg, "reward.params") or OmegaConf.create({}), resolve=True)
    problems += rewards.problems(weights, params)
    if not _missing_keys(cfg.data):
        problems += data.problems(cfg.data, rewards.columns_needed(weights))
    return problems


def gpu_only_problems(cfg: DictConfig) -> list[str]:
    """What this config needs a GPU for; checked where the job runs (or, for a sweep, on the machine it runs on)."""
    problems = []
    if cfg.trainer.get("use_vllm") and cfg.trainer.get("vllm_enable_sleep_mode"):
        problems.append(
            "trainer.vllm_enable_sleep_mode=true (placement=colocate_sleep) needs a GPU; vLLM on CPU has no sleep mode"
        )
    if cfg.placement.get("model_runner_v2"):
        problems.append("placement.model_runner_v2=true needs a GPU: vLLM's CPU backend has no model runner v2")
    if cfg.parallelism.name == "fsdp":
        problems.append(
            "parallelism=fsdp needs GPUs: accelerate turns FSDP on only for GPU-like devices, so on CPU it would "
            "train plain DDP under an FSDP name; use parallelism=ddp here"
        )
    return problems


# ------------------------------------------------------------------ optional backends: DeepSpeed ZeRO-3, peft adapters

PEFT_CONFIG_CLASSES = {"lora": "LoraConfig"}  # peft.name → the peft config class it builds


def peft_name(cfg: DictConfig) -> str:
    """The adapter kind of this config; `none` also for configs written before the group existed."""
    return str(OmegaConf.select(cfg, "peft.name", default="none"))


def peft_options(cfg: DictConfig) -> dict:
    """The peft config's keyword arguments: every key of the group but `name`."""
    return {k: v for k, v in OmegaConf.to_container(cfg.peft, resolve=True).items() if k != "name"}


def peft_config(cfg: DictConfig):
    """What GRPOTrainer(peft_config=…) receives: peft.LoraConfig(task_type="CAUSAL_LM", …), or None for peft=none."""
    kind = peft_name(cfg)
    if kind == "none":
        return None
    import peft

    return getattr(peft, PEFT_CONFIG_CLASSES[kind])(**{"task_type": "CAUSAL_LM", **peft_options(cfg)})


def backend_problems(cfg: DictConfig) -> list[str]:
    """The parallelism and peft groups and Liger kernels: their packages, the adapter's options, and combinations TRL
    refuses."""
    problems = []
    trainer = cfg.trainer
    if cfg.parallelism.name.startswith("zero3"):
        if importlib.util.find_spec("deepspeed") is None:
            problems.append(
                f"parallelism={cfg.parallelism.name} needs the `deepspeed` package: pip install "
                '"colocated-grpo[deepspeed]" (or use parallelism=ddp / fsdp)'
            )
        if trainer.get("fsdp"):
            problems.append(
                f"parallelism={cfg.parallelism.name} and trainer.fsdp={trainer.fsdp!r} both shard the model: "
                "transformers takes one of DeepSpeed and FSDP; drop trainer.fsdp or use parallelism=fsdp"
            )
    if trainer.get("use_liger_kernel") and importlib.util.find_spec("liger_kernel") is None:
        problems.append(
            "trainer.use_liger_kernel=true needs the `liger-kernel` package (a GPU one): pip install liger-kernel "
            "(or trainer.use_liger_kernel=false)"
        )
    kind = peft_name(cfg)
    if kind == "none":
        return problems
    if kind not in PEFT_CONFIG_CLASSES:
        return [*problems, f"peft.name={kind!r} must be one of {['none', *PEFT_CONFIG_CLASSES]}"]
    if importlib.util.find_spec("peft") is None:
        problems.append(f'peft={kind} needs the `peft` package: pip install "colocated-grpo[peft]" (or peft=none)')
    else:
        problems += _adapter_option_problems(cfg, kind)
    if trainer.get("sync_ref_model"):
        problems.append(
            f"trainer.sync_ref_model=true with peft={kind}: TRL has no reference model to sync with adapters (it "
            "disables the adapters instead); set trainer.sync_ref_model=false or peft=none"
        )
    return problems


def _adapter_option_problems(cfg: DictConfig, kind: str) -> list[str]:
    import peft

    fields = {f.name for f in dataclasses.fields(getattr(peft, PEFT_CONFIG_CLASSES[kind]))}
    options = peft_options(cfg)
    problems = []
    for key in sorted(set(options) - fields):
        near = difflib.get_close_matches(key, fields, n=1)
        hint = f" (did you mean peft.{near[0]}?)" if near else ""
        problems.append(f"peft.{key} is not a peft.{PEFT_CONFIG_CLASSES[kind]} field{hint}")
    r, alpha, dropout = options.get("r"), options.get("lora_alpha"), options.get("lora_dropout")
    if r is not None and not (isinstance(r, int) and not isinstance(r, bool) and r > 0):
        problems.append(f"peft.r={r!r} must be a positive integer (the adapter rank, e.g. 16)")
    if alpha is not None and not (isinstance(alpha, int | float) and alpha > 0):
        problems.append(f"peft.lora_alpha={alpha!r} must be a positive number (e.g. 2 × peft.r)")
    if dropout is not None and not (isinstance(dropout, int | float) and 0 <= dropout < 1):
        problems.append(f"peft.lora_dropout={dropout!r} must be in [0, 1)")
    targets = options.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets or []
    if "lm_head" in names:
        problems.append(
            "peft.target_modules includes lm_head: TRL computes log-probs from lm_head.weight directly, so an adapter "
            "there would never train; remove lm_head (all-linear already leaves it out)"
        )
    return problems


def _model_problems(model: DictConfig) -> list[str]:
    if model.get("build"):
        if model.build not in SHAPES:
            return [f"model.build={model.build!r} is not a known shape; choose one of {sorted(SHAPES)}"]
        return []
    path = str(model.name_or_path)
    # Hub ids are "org/name"; anything else with a slash, or starting like a path, is a local directory.
    looks_local = path.startswith(("/", ".", "~")) or path.count("/") > 1 or Path(path).exists()
    if looks_local and not (Path(path).expanduser() / "config.json").exists():
        return [
            f"model.name_or_path={path!r}: no model directory there (config.json missing); "
            "give an existing directory, a hub id like Qwen/Qwen2.5-1.5B-Instruct, or a model with `build:`"
        ]
    return []


def _heads_problems(model: DictConfig, tp: int, key: str) -> list[str]:
    if tp < 1 or OmegaConf.is_missing(model, "name_or_path") or _model_problems(model):
        return []  # reported elsewhere
    try:
        arch = models.architecture(model, network=True)  # without loading weights; the hub is asked last
    except Exception as exc:  # an unreachable hub id: say so instead of failing later inside vLLM
        return [
            f"model.name_or_path={model.name_or_path!r}: cannot read its config.json ({type(exc).__name__}: {exc}); "
            "give a local model directory or a hub id (org/name) that exists and is reachable from here"
        ]
    problems = []
    for what, n in (("attention heads", arch.num_attention_heads), ("KV heads", arch.num_key_value_heads)):
        if n % tp:
            problems.append(
                f"{key}={tp} must divide the model's {n} {what} ({model.name_or_path}); use one of {_divisors(n)}"
            )
    return problems


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


OVERLAP_IS_MODE = "token_truncate"  # trainer.vllm_importance_sampling_mode under placement.overlap, unless given


def grpo_config(cfg: DictConfig, output_dir: str, report_to: list[str], derived: dict | None = None):
    """trl.GRPOConfig from `trainer.*`, what the runner owns and what the data derived (`derived`) where unset.
    TRL's own refusals become a ConfigError naming the trainer keys."""
    import torch
    from trl import GRPOConfig

    kwargs = OmegaConf.to_container(cfg.trainer, resolve=True)
    kwargs.update({key: value for key, value in (derived or {}).items() if kwargs.get(key) is None})
    if not torch.cuda.is_available():
        # Without it, transformers ignores torchrun on CPU and every rank trains alone (world size 1).
        kwargs.setdefault("use_cpu", True)
    kwargs.setdefault("model_init_kwargs", {}).setdefault("dtype", cfg.model.get("dtype", "auto"))
    # Our generation settings go under the user's own trainer.generation_kwargs, which win.
    ours = fixed_length_kwargs(kwargs) if cfg.run.fixed_completion_length else {}
    if profile := length_profile(cfg):
        ours.update(profile.generation_kwargs())
    users = kwargs.get("generation_kwargs") or {}
    if stops := _stop_strings(users):
        users["stop"] = stops
    if kwargs.get("use_vllm") and kwargs.get("vllm_mode") == "colocate" and cfg.placement.get("fast_outputs"):
        from colocated_grpo.compat.vllm import fast_output_kwargs

        ours.update(fast_output_kwargs())
        # vLLM matches stop strings on the text; a user's own detokenize wins (and says so itself)
        if stops and ours.pop("detokenize", None) is not None and "detokenize" not in users:
            log.info("placement.fast_outputs keeps the text detokenized: trainer.generation_kwargs.stop needs it")
    if stops and users.get("detokenize") is False:
        raise ConfigError(
            ["trainer.generation_kwargs: stop strings need detokenize=true (vLLM matches them on the text)"]
        )
    if ours or users:
        kwargs["generation_kwargs"] = {**ours, **users}
    if cfg.placement.get("overlap") and kwargs.get("vllm_importance_sampling_mode") is None:
        # One step off-policy, TRL's default (sequence_mask) zeroes every completion whose whole-sequence ratio passes
        # its cap: mostly those the last update made likelier, so learning slows or turns back. Per token, truncated,
        # overlap learned close to in-process (sweeps/results/overlap_learning_cpu).
        kwargs["vllm_importance_sampling_mode"] = OVERLAP_IS_MODE
        log.info("placement.overlap: the importance-sampling ratio per token, truncated (%s)", OVERLAP_IS_MODE)
    ours = dict(output_dir=output_dir, report_to=report_to, run_name=cfg.run.name, seed=int(cfg.seed))
    ours["reward_weights"] = [float(w) for w in cfg.reward.weights.values()]
    try:
        return GRPOConfig(**ours, **kwargs)
    except (ValueError, TypeError) as exc:  # TRL's and transformers' own rules on the combination of settings
        raise ConfigError(
            [f"trainer: trl.GRPOConfig refuses these settings: {exc} (field names are trainer.* keys)"]
        ) from exc


ESCAPES = {"\\n": "\n", "\\t": "\t", "\\r": "\r"}


def _stop_strings(generation_kwargs: dict) -> list[str]:
    """The stop strings asked for, `\\n`, `\\t`, `\\r` read as the characters (Hydra passes them on escaped)."""
    stop = generation_kwargs.get("stop")
    decoded = []
    for text in [stop] if isinstance(stop, str) else list(stop or []):
        new = re.sub(r"\\[ntr]", lambda m: ESCAPES[m[0]], str(text))
        if new != text:
            log.info("trainer.generation_kwargs.stop: %r read as %r", text, new)
        decoded.append(new)
    return decoded


def length_profile(cfg: DictConfig) -> lengths.LengthProfile | None:
    """The profile run.length_profile names, for this config's model, cap and temperature; None without one."""
    if cfg.run.length_profile is None:
        return None
    path = models.resolve(cfg.model)  # a model built here exists from now on, its config.json too
    cap, temperature = (trainer_value(cfg.trainer, key) for key in ("max_completion_length", "temperature"))
    vocab = models.architecture(cfg.model, network=True).vocab_size
    return lengths.resolve(cfg.run.length_profile, int(cap), float(temperature), path, int(vocab))


def fixed_length_kwargs(trainer: dict) -> dict:
    """Generation kwargs that make every completion exactly max_completion_length tokens (EOS suppressed)."""
    length = int(trainer.get("max_completion_length", 256))
    if trainer.get("use_vllm"):
        return {"min_tokens": length, "ignore_eos": True}
    return {"min_new_tokens": length}
