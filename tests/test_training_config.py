"""Every experiment composes and validates; each bad input fails before any model is loaded, naming key and fix."""

import importlib.util
import json
import os
import sys
import typing

import pytest
import torch
from conftest import CONF, compose_train, config_problems, run_bounded
from hydra.errors import ConfigCompositionException
from omegaconf import open_dict

from colocated_grpo.training.config import ConfigError, grpo_config, validate

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


pytestmark = pytest.mark.usefixtures("offline_config")


def test_required_experiments_exist():
    assert {"qwen_colocate", "qwen_colocate_sleep", "qwen_hf", "tiny_cpu", "gpu_smoke"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_composes_and_validates(experiment):
    cfg = compose_train(f"+experiment={experiment}")
    validate(cfg)
    if not torch.cuda.is_available():  # transformers refuses bf16 on a machine without a GPU
        cfg.trainer.bf16 = False
    args = grpo_config(cfg, output_dir="unused", report_to=[])
    assert args.num_generations == cfg.trainer.num_generations


def test_qwen_colocate_is_what_it_says():
    cfg = compose_train("+experiment=qwen_colocate")
    assert cfg.model.name_or_path.startswith("Qwen/Qwen2.5-") and cfg.data.source == "gsm8k"
    assert set(cfg.reward.weights) == {"math_accuracy", "boxed_format"}
    t = cfg.trainer
    assert (t.use_vllm, t.vllm_mode, t.vllm_tensor_parallel_size, t.vllm_gpu_memory_utilization, t.bf16) == (
        True,
        "colocate",
        1,
        0.3,
        True,
    )
    assert compose_train("+experiment=qwen_colocate_sleep").trainer.vllm_enable_sleep_mode is True
    assert compose_train("+experiment=qwen_hf").trainer.use_vllm is False


def test_default_is_tiny_offline_colocate():
    cfg = compose_train()
    assert cfg.model.build == "tiny" and cfg.data.source == "arithmetic" and cfg.trainer.vllm_mode == "colocate"
    assert cfg.logger.backend == "wandb"


def _fails(match, *overrides, world=None):
    cfg = compose_train(*overrides)
    with pytest.raises(ConfigError, match=match):
        validate(cfg, world)


@pytest.mark.parametrize("steps", [0, -2])
def test_max_steps_must_train_something(steps):
    _fails(f"trainer.max_steps={steps} must be a positive number of steps, or -1", f"trainer.max_steps={steps}")


def test_tp_must_divide_world_size():
    _fails(
        r"trainer.vllm_tensor_parallel_size=2 must divide the world size 3.*use one of \[1, 3\]",
        "trainer.vllm_tensor_parallel_size=2",
        world=3,
    )


def test_tp_must_divide_attention_and_kv_heads():
    # Qwen2.5-7B: 28 heads, 4 KV heads. TP 8 divides the world of 8 but neither head count.
    cfg = compose_train("+experiment=qwen_colocate", "model=qwen2.5-7b-instruct", "trainer.vllm_tensor_parallel_size=8")
    with pytest.raises(ConfigError) as err:
        validate(cfg, 8)
    assert "divide the model's 28 attention heads" in str(err.value) and "4 KV heads" in str(err.value)
    # the tiny model has 2 heads: TP 4 fails on heads even when the world allows it
    _fails(r"model's 2 attention heads", "trainer.vllm_tensor_parallel_size=4", world=4)


@pytest.mark.parametrize("mem", [0, 1, 1.5, -0.1])
def test_gpu_memory_utilization_strictly_between_0_and_1(mem):
    _fails(
        r"trainer.vllm_gpu_memory_utilization=.* strictly between 0 and 1", f"trainer.vllm_gpu_memory_utilization={mem}"
    )


def test_num_generations_must_divide_generation_batch():
    _fails(r"trainer.num_generations=3 must divide the generation batch 4.*\[2, 4\]", "trainer.num_generations=3")


def test_unknown_reward_lists_registered_ones():
    _fails(
        r"unknown reward 'accuracy'.*; registered: \[.*'exact_answer'.*'math_accuracy'", "+reward.weights.accuracy=1.0"
    )


def test_missing_local_model_path(tmp_path):
    _fails(
        r"model.name_or_path='.*/nope': no model directory there", "model=local", f"model.name_or_path={tmp_path}/nope"
    )


def test_unknown_trainer_key_is_not_a_grpo_field():
    _fails(r"trainer.max_prompt_length is not a trl.GRPOConfig field", "+trainer.max_prompt_length=128")


def test_all_problems_reported_at_once():
    cfg = compose_train("trainer.vllm_gpu_memory_utilization=2", "trainer.num_generations=3")
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    assert len(err.value.problems) == 2


def test_unknown_group_option_is_hydras_error():
    with pytest.raises(ConfigCompositionException, match="Could not find 'placement/colocated'"):
        compose_train("placement=colocated")


def test_none_placement_skips_vllm_checks():
    cfg = compose_train("placement=none")
    with open_dict(cfg):
        cfg.trainer.vllm_tensor_parallel_size = 3  # irrelevant without vLLM
    validate(cfg, 1)


def test_fixed_completion_length_maps_to_each_backends_own_kwargs():
    cfg = compose_train("+experiment=gpu_smoke", "trainer.bf16=false", "trainer.max_completion_length=96")
    kwargs = grpo_config(cfg, "unused", []).generation_kwargs
    assert {"min_tokens": 96, "ignore_eos": True}.items() <= kwargs.items()
    cfg = compose_train(
        "+experiment=gpu_smoke",
        "placement=none",
        "trainer.bf16=false",
        "+trainer.generation_kwargs={min_new_tokens: 8}",
    )
    assert grpo_config(cfg, "unused", []).generation_kwargs == {"min_new_tokens": 8}, "the user's own kwargs win"
    cfg = compose_train(
        "+experiment=gpu_smoke", "placement=none", "trainer.bf16=false", "run.fixed_completion_length=false"
    )
    assert grpo_config(cfg, "unused", []).generation_kwargs is None


@pytest.mark.parametrize(
    "override, says",
    [
        ("run.cpu_kvcache_gb=abc", "Value 'abc' of type 'str' could not be converted to Float"),
        ("run.fixed_completion_length=sometimes", "Value 'sometimes' is not a valid bool"),
        ("telemetry.interval_s=abc", "Value 'abc' of type 'str' could not be converted to Float"),
        ("run.resum=auto", "Key 'resum' not in 'Run'"),
    ],
)
def test_our_own_groups_refuse_a_wrong_type_or_key_as_hydra_composes_naming_it(override, says):
    with pytest.raises(ConfigCompositionException) as err:
        compose_train(override)
    assert says in str(err.value.__cause__) and f"full_key: {override.split('=')[0]}" in str(err.value.__cause__)


# gpu_smoke sets run.name (the default takes it from Hydra's runtime); its fixed lengths are turned off here.
SMOKE = ("+experiment=gpu_smoke", "trainer.bf16=false", "run.fixed_completion_length=false")


@pytest.mark.parametrize("placement", ["colocate", "colocate_sleep"])
def test_fast_outputs_reach_the_colocated_engines_sampling_params(placement):
    cfg = compose_train(*SMOKE, f"placement={placement}")
    assert grpo_config(cfg, "unused", []).generation_kwargs == {"detokenize": False, "flat_logprobs": True}
    cfg = compose_train(*SMOKE, f"placement={placement}", "placement.fast_outputs=false")
    assert grpo_config(cfg, "unused", []).generation_kwargs is None, "false: TRL's own request"
    cfg = compose_train(*SMOKE, f"placement={placement}", "+trainer.generation_kwargs={detokenize: true}")
    assert grpo_config(cfg, "unused", []).generation_kwargs == {"detokenize": True, "flat_logprobs": True}


def test_stop_strings_keep_the_text_detokenized_and_their_escapes_are_read(caplog):
    """vLLM matches stop strings on the text (detokenize=False refuses them at the first generate); Hydra hands
    `"\n\n"` on as backslash-n, which no completion would contain."""
    cfg = compose_train(*SMOKE, 'trainer.generation_kwargs={stop:["\\n\\n"]}')
    with caplog.at_level("INFO"):
        assert grpo_config(cfg, "unused", []).generation_kwargs == {"flat_logprobs": True, "stop": ["\n\n"]}
    assert "placement.fast_outputs keeps the text detokenized" in caplog.text
    caplog.clear()  # the user's own detokenize=true: nothing of ours to say
    cfg = compose_train(*SMOKE, 'trainer.generation_kwargs={stop:["x"],detokenize:true}')
    with caplog.at_level("INFO"):
        kwargs = grpo_config(cfg, "unused", []).generation_kwargs
    assert kwargs == {"flat_logprobs": True, "stop": ["x"], "detokenize": True}
    assert "placement.fast_outputs" not in caplog.text
    cfg = compose_train(*SMOKE, "placement.fast_outputs=false", '+trainer.generation_kwargs.stop=".\\t"')
    assert grpo_config(cfg, "unused", []).generation_kwargs == {"stop": [".\t"]}
    cfg = compose_train(*SMOKE, 'trainer.generation_kwargs={stop:["x"],detokenize:false}')
    with pytest.raises(ConfigError, match=r"stop strings need detokenize=true"):
        grpo_config(cfg, "unused", [])


@pytest.mark.parametrize("placement", ["none", "server"])
def test_fast_outputs_leave_other_placements_alone(placement):
    cfg = compose_train(*SMOKE, f"placement={placement}", "+placement.fast_outputs=true")
    assert grpo_config(cfg, "unused", []).generation_kwargs is None


# Any GRPOConfig field, without `+`, checked against the field's type before anything loads.


def test_any_grpo_field_is_set_without_plus_and_reaches_grpo_config():
    cfg = compose_train(
        "+experiment=tiny_cpu", "trainer.top_p=0.9", "trainer.repetition_penalty=1.1", "reward.weights.boxed_format=0.5"
    )
    validate(cfg, 1)
    args = grpo_config(cfg, "unused", [])
    assert (args.top_p, args.repetition_penalty, args.reward_weights) == (0.9, 1.1, [1.0, 0.5, 0.05])
    # the `+` form keeps working for a field the yaml does not list
    assert grpo_config(compose_train("+experiment=tiny_cpu", "+trainer.top_k=5"), "unused", []).top_k == 5


def test_trainer_values_are_checked_against_grpo_field_types_all_at_once():
    cfg = compose_train(
        "trainer.max_steps=abc", "trainer.bf16=maybe", "trainer.lr_scheduler_type=cosin", "trainer.top_pp=0.9"
    )
    with pytest.raises(ConfigError) as err:
        validate(cfg, 1)
    problems = err.value.problems
    assert len(problems) == 4, problems
    assert "trainer.max_steps='abc' must be an integer" in problems[0]
    assert "trainer.bf16='maybe' must be true or false" in problems[1]
    assert "trainer.lr_scheduler_type='cosin' must be one of ['linear', 'cosine'" in problems[2]
    assert (
        "trainer.top_pp is not a trl.GRPOConfig field" in problems[3] and "did you mean trainer.top_p?" in problems[3]
    )


def test_the_field_table_of_the_installed_trl_is_grpo_configs_own():
    from scripts.write_grpo_fields import field_table

    from colocated_grpo.training.config import FIELD_TABLES

    live = field_table()
    shipped = [t for t in json.loads(FIELD_TABLES.read_text()) if t["versions"] == live["versions"]]
    assert shipped == [live], "another TRL or transformers: python tests/scripts/write_grpo_fields.py writes its table"


def test_each_field_type_read_from_the_table_describes_and_checks_values_as_grpo_configs_own():
    from scripts.write_grpo_fields import field_table
    from trl import GRPOConfig

    from colocated_grpo.training import field_types
    from colocated_grpo.training.config import FIELD_TABLES, grpo_fields

    (table,) = [t for t in json.loads(FIELD_TABLES.read_text()) if t["versions"] == field_table()["versions"]]
    hints = typing.get_type_hints(GRPOConfig)
    probes = [1, 1.5, "steps", "no", "bf16", True, False, None, [1], ["a"], {"a": 1}]
    untyped = []
    for name, (annotation, default) in grpo_fields().items():
        if "Any" in table["fields"][name][0].replace("dict[str, Any]", ""):  # no JSON form: any value passes
            untyped.append(name)
            continue
        assert field_types.describe(annotation) == field_types.describe(hints[name]), name
        for value in [*probes, default]:
            assert field_types.fits(value, annotation) == field_types.fits(value, hints[name]), (name, value)
    assert untyped == ["parallelism_config"]  # accelerate's ParallelismConfig object


def test_every_tables_types_read_back_as_spelled_and_nothing_else_is_run():
    """Each type text of each pin's table (the GPU pin's too) reads back into the annotation the writer spells it
    from; text that is no type is refused, not evaluated."""
    from scripts.write_grpo_fields import spell

    from colocated_grpo.training.config import FIELD_TABLES, read_type

    tables = json.loads(FIELD_TABLES.read_text())
    assert len(tables) >= 2
    for table in tables:
        for name, (text, _) in table["fields"].items():
            assert spell(read_type(text)) == text, (table["versions"], name)
    for text in ("__import__('os').getcwd()", "int | os", "Literal[print('x')]", "list[1]"):
        with pytest.raises(ValueError, match="not a type the field table spells"):
            read_type(text)


def test_without_a_table_for_the_installed_versions_the_fields_come_from_grpo_config(tmp_path, monkeypatch):
    from trl import GRPOConfig

    from colocated_grpo.training import config

    (tmp_path / "tables.json").write_text("[]")
    monkeypatch.setattr(config, "FIELD_TABLES", tmp_path / "tables.json")
    config.grpo_fields.cache_clear()
    try:
        fields = config.grpo_fields()
        assert fields["lr_scheduler_type"] == (
            typing.get_type_hints(GRPOConfig)["lr_scheduler_type"],
            GRPOConfig.__dataclass_fields__["lr_scheduler_type"].default,
        )
        problems = config_problems("trainer.lr_scheduler_type=cosin", "trainer.top_pp=0.9")
    finally:
        config.grpo_fields.cache_clear()
    assert "trainer.lr_scheduler_type='cosin' must be one of ['linear', 'cosine'" in problems
    assert "did you mean trainer.top_p?" in problems


def test_validating_a_config_with_the_table_imports_no_torch_transformers_or_trl():
    """What a sweep's parent does for each job before it starts one (~1 s of CPU instead of ~5)."""
    code = (
        "import sys; from hydra import compose, initialize_config_dir; "
        "from colocated_grpo.training.config import validate; "
        f"initialize_config_dir(config_dir={str(CONF)!r}, version_base='1.3'); "
        "validate(compose('train', ['+experiment=qwen_colocate', 'trainer.max_steps=3']), 1); "
        "print(sorted(m for m in ('torch', 'transformers', 'trl.trainer.grpo_config') if m in sys.modules))"
    )
    proc = run_bounded([sys.executable, "-c", code], env=dict(os.environ), timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr


def test_model_init_kwargs_that_is_no_mapping_is_one_config_problem():
    problems = config_problems("+experiment=tiny_cpu", "trainer.model_init_kwargs=null")
    assert problems == (
        "invalid config:\n  - trainer.model_init_kwargs=None must be a mapping of from_pretrained's keyword arguments "
        "(e.g. trainer.model_init_kwargs={attn_implementation:sdpa}), or left out; model.dtype sets the dtype"
    )
    cfg = compose_train("+experiment=tiny_cpu", "trainer.model_init_kwargs={attn_implementation:sdpa}")
    validate(cfg, 1)  # the form the message suggests
    assert grpo_config(cfg, "unused", []).model_init_kwargs == {"attn_implementation": "sdpa", "dtype": "float32"}


def test_trls_own_rules_refuse_with_a_config_error():
    cfg = compose_train("+experiment=tiny_cpu", "trainer.auto_find_batch_size=true")
    validate(cfg, 1)  # a valid type; TRL's __post_init__ refuses the combination
    with pytest.raises(ConfigError, match=r"trainer: trl.GRPOConfig refuses these settings: .*auto_find_batch_size"):
        grpo_config(cfg, "unused", [])


def test_completion_must_fit_in_the_engines_length():
    _fails(
        r"trainer.max_completion_length=1024 leaves no room for a prompt in trainer.vllm_max_model_length=256",
        "trainer.max_completion_length=1024",
    )
    _fails(
        r"data.max_prompt_tokens=300 \+ trainer.max_completion_length=32 = 332 exceed "
        r"trainer.vllm_max_model_length=256",
        "data.max_prompt_tokens=300",
    )
    # the tiny model's context is 1024 tokens (max_position_embeddings of its shape)
    _fails(
        r"trainer.vllm_max_model_length=2048 exceeds the model's context of 1024", "trainer.vllm_max_model_length=2048"
    )
    validate(compose_train("trainer.vllm_max_model_length=null"), 1)  # derived from the prompts at the start of a run


# Models: a missing path says what to set; checks read the model's own config.json.


def test_model_local_without_path_names_the_key():
    _fails(r"model.name_or_path is not set \(\?\?\?\): model=local needs the model: model.name_or_path=", "model=local")


def test_overridden_name_or_path_is_checked_with_its_own_config_json(tmp_path):
    from colocated_grpo.training import models

    tiny = models.build("tiny", tmp_path / "tiny")  # 2 heads, 2 KV heads; the 7B preset declares 28 and 4
    overrides = ("model=qwen2.5-7b-instruct", f"model.name_or_path={tiny}", "trainer.vllm_tensor_parallel_size=4")
    _fails(r"must divide the model's 2 attention heads", *overrides, world=4)
    validate(compose_train("model=qwen2.5-7b-instruct", "trainer.vllm_tensor_parallel_size=4"), 4)


# The blog's example, and the help page.


def test_tldr_experiment_is_the_blog_example():
    cfg = compose_train("+experiment=tldr_colocate")
    assert cfg.model.name_or_path == "Qwen/Qwen2-0.5B-Instruct"
    assert (cfg.data.source, cfg.data.path, cfg.data.split, cfg.data.answer_column) == (
        "hub",
        "trl-lib/tldr",
        "train",
        None,
    )
    assert dict(cfg.reward.weights) == {"length_chars": 1.0} and cfg.reward.params.length_chars.target == 20
    t = cfg.trainer
    assert (t.vllm_mode, t.vllm_tensor_parallel_size, t.vllm_gpu_memory_utilization) == ("colocate", 1, 0.3)
    assert (t.num_generations, t.per_device_train_batch_size, t.max_completion_length) == (4, 4, 1024)
    validate(cfg, 1)  # no download: the preset declares the model's published config


def test_help_lists_groups_and_their_options():
    import sys

    from colocated_grpo.launch.processes import TRAIN_SCRIPT

    proc = run_bounded([sys.executable, str(TRAIN_SCRIPT), "--help"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for line in ("data: arithmetic, gsm8k, hub, local", "reward: arithmetic, even_tokens, length, length_chars, math"):
        assert line in out
    assert (
        "model: local, qwen2-0.5b-instruct," in out
        and "tldr_colocate" in out
        and "trainer: qwen, throughput, tiny" in out
    )
    assert "any trl.GRPOConfig field, without +" in out


def test_reward_weights_and_params_take_new_keys_without_plus():
    cfg = compose_train("reward=length", "reward.params.length.target=8", "reward.weights.length_chars=0.5")
    assert dict(cfg.reward.weights) == {"length": 1.0, "length_chars": 0.5} and cfg.reward.params.length.target == 8
    validate(cfg, 1)
    _fails(r"reward.params.length.targt: reward 'length' takes no parameter 'targt'", "reward.params.length.targt=8")


def test_every_option_of_every_group_says_what_it_is():
    for path in CONF.glob("*/*.yaml"):
        assert path.read_text().startswith("#"), f"{path} starts with a comment saying what it is and its keys mean"


def test_liger_kernels_without_their_package_are_refused_before_loading(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a)
    )
    message = config_problems("trainer.use_liger_kernel=true")
    assert (
        "trainer.use_liger_kernel=true needs the `liger-kernel` package (a GPU one): pip install liger-kernel"
        in message
    )
    validate(compose_train("trainer.use_liger_kernel=false"))  # off: the package is not needed


def test_the_model_runner_v2_is_asked_of_vllm_on_a_gpu_and_refused_without_one(monkeypatch):
    from colocated_grpo.training import build
    from colocated_grpo.training.config import gpu_only_problems

    assert gpu_only_problems(compose_train()) == []
    cfg = compose_train("placement.model_runner_v2=true")
    (problem,) = gpu_only_problems(cfg)
    assert problem.startswith("placement.model_runner_v2=true needs a GPU")
    # on a GPU (torch's answer stands in for one here): vLLM is asked for it before the engine is built
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    try:
        build.prepare_environment(compose_train())
        assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
        build.prepare_environment(cfg)
        assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)


def test_overlap_takes_the_importance_sampling_ratio_per_token_unless_one_is_given():
    """One step off-policy, TRL's default mode (a whole-sequence ratio masked past its cap) drops the completions the
    last update made likelier; overlap takes the per-token truncated ratio (sweeps/results/overlap_learning_cpu)."""
    overlap = ("run.name=overlap", "placement=colocate_process", "placement.overlap=true")
    assert grpo_config(compose_train(*overlap), "unused", []).vllm_importance_sampling_mode == "token_truncate"
    given = compose_train(*overlap, "+trainer.vllm_importance_sampling_mode=sequence_truncate")
    assert grpo_config(given, "unused", []).vllm_importance_sampling_mode == "sequence_truncate"
    without = compose_train("run.name=process", "placement=colocate_process")
    assert grpo_config(without, "unused", []).vllm_importance_sampling_mode == "sequence_mask", "TRL's default"


def test_the_engine_in_its_own_process_refuses_what_it_does_not_support_before_anything_loads():
    """One engine per rank, its weights sent whole: TP above 1, sharded parallelism, adapters and overlap with sleep
    mode are refused, one line each, naming what to use instead."""
    said = config_problems(
        "placement=colocate_process",
        "trainer.vllm_tensor_parallel_size=2",
        "parallelism=zero3",
        "parallelism.nproc_per_node=2",
        "peft=lora",
        "placement.overlap=true",
        "trainer.vllm_enable_sleep_mode=true",
    )
    for line in (
        "trainer.vllm_tensor_parallel_size=2 needs placement=colocate",
        "parallelism=zero3 shards them; use parallelism=ddp or placement=colocate",
        "peft=lora is not supported there yet; use placement=colocate",
        "placement.overlap=true generates while training runs, so the engine cannot sleep",
    ):
        assert line in said, said
    validate(compose_train("placement=colocate_process"))  # its defaults pass


def test_overlap_refuses_to_train_off_policy_without_the_importance_sampling_correction():
    said = config_problems(
        "placement=colocate_process", "placement.overlap=true", "+trainer.vllm_importance_sampling_correction=false"
    )
    assert "set trainer.vllm_importance_sampling_correction=true" in said, said


@pytest.mark.parametrize("value", ["off", "no", "flase", "maybe"])
def test_a_placement_switch_that_is_not_a_boolean_is_refused(value):
    said = config_problems("placement=colocate_process", f"placement.overlap={value}")
    assert f"placement.overlap={value!r} must be true or false" in said, said
