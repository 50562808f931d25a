"""Every experiment composes and validates; each bad input fails before any model is loaded, naming key and fix."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import open_dict

from colocated_grpo.training.config import ConfigError, grpo_config, validate

CONF = Path(__file__).resolve().parents[1] / "conf"
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def compose_train(*overrides):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=False)


@pytest.fixture(autouse=True)
def _offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOCATED_GRPO_CACHE", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)


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
    with pytest.raises(ConfigCompositionException, match="Could not find 'vllm/colocated'"):
        compose_train("vllm=colocated")


def test_none_placement_skips_vllm_checks():
    cfg = compose_train("vllm=none")
    with open_dict(cfg):
        cfg.trainer.vllm_tensor_parallel_size = 3  # irrelevant without vLLM
    validate(cfg, 1)


def test_fixed_completion_length_maps_to_each_backends_own_kwargs():
    cfg = compose_train("+experiment=gpu_smoke", "trainer.bf16=false", "trainer.max_completion_length=96")
    kwargs = grpo_config(cfg, "unused", []).generation_kwargs
    assert {"min_tokens": 96, "ignore_eos": True}.items() <= kwargs.items()
    cfg = compose_train(
        "+experiment=gpu_smoke", "vllm=none", "trainer.bf16=false", "+trainer.generation_kwargs={min_new_tokens: 8}"
    )
    assert grpo_config(cfg, "unused", []).generation_kwargs == {"min_new_tokens": 8}, "the user's own kwargs win"
    cfg = compose_train("+experiment=gpu_smoke", "vllm=none", "trainer.bf16=false", "run.fixed_completion_length=false")
    assert grpo_config(cfg, "unused", []).generation_kwargs is None
    _fails("run.fixed_completion_length must be true or false", "run.fixed_completion_length=sometimes")


# gpu_smoke sets run.name (the default takes it from Hydra's runtime); its fixed lengths are turned off here.
SMOKE = ("+experiment=gpu_smoke", "trainer.bf16=false", "run.fixed_completion_length=false")


@pytest.mark.parametrize("placement", ["colocate", "colocate_sleep"])
def test_fast_outputs_reach_the_colocated_engines_sampling_params(placement):
    cfg = compose_train(*SMOKE, f"vllm={placement}")
    assert grpo_config(cfg, "unused", []).generation_kwargs == {"detokenize": False, "flat_logprobs": True}
    cfg = compose_train(*SMOKE, f"vllm={placement}", "placement.fast_outputs=false")
    assert grpo_config(cfg, "unused", []).generation_kwargs is None, "false: TRL's own request"
    cfg = compose_train(*SMOKE, f"vllm={placement}", "+trainer.generation_kwargs={detokenize: true}")
    assert grpo_config(cfg, "unused", []).generation_kwargs == {"detokenize": True, "flat_logprobs": True}


@pytest.mark.parametrize("placement", ["none", "server"])
def test_fast_outputs_leave_other_placements_alone(placement):
    cfg = compose_train(*SMOKE, f"vllm={placement}", "+placement.fast_outputs=true")
    assert grpo_config(cfg, "unused", []).generation_kwargs is None
