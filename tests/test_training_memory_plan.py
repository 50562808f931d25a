"""Gradient checkpointing is chosen from memory before the model loads (training.memory_plan): off where a
micro-batch's activations fit beside the engine's share, on where not, never against the user's own setting."""

import json

import pytest
from conftest import compose_train

from colocated_grpo.training import memory_plan

pytestmark = pytest.mark.usefixtures("offline_config")

GIB = 2**30
H200 = 140.4 * GIB  # what torch reports of one H200
# Qwen2.5-1.5B's published config.json, the keys the plan reads
QWEN_1_5B = {
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def qwen_1_5b(tmp_path):
    """A model directory with only the config (the plan reads no weights)."""
    (tmp_path / "qwen").mkdir()
    (tmp_path / "qwen" / "config.json").write_text(json.dumps(QWEN_1_5B))
    return tmp_path / "qwen"


def _cfg(model_dir, *overrides):
    return compose_train(
        "+experiment=gpu_smoke", "model=local", f"model.name_or_path={model_dir}", "model.dtype=bfloat16", *overrides
    )


def _on_an_h200(monkeypatch, share: float | None = 0.3):
    budget = H200 * (1 - share) if share else H200
    monkeypatch.setattr(memory_plan, "budget_bytes", lambda cfg: (budget, "GiB on the GPU"))


def test_the_parameters_of_a_shape_are_the_published_count():
    shape = QWEN_1_5B
    count = memory_plan._parameters(shape["hidden_size"], shape["intermediate_size"], 28, 256, shape["vocab_size"])
    assert abs(count - 1.54e9) / 1.54e9 < 0.01  # Qwen2.5-1.5B: 1.54e9 parameters (tied embeddings)


def test_checkpointing_goes_off_where_the_micro_batch_fits_beside_the_engine(qwen_1_5b, monkeypatch):
    _on_an_h200(monkeypatch, share=0.3)
    chosen, line = memory_plan.choose(_cfg(qwen_1_5b, "trainer.per_device_train_batch_size=64"), longest_prompt=40)
    assert chosen == {"gradient_checkpointing": False}
    assert line.startswith("gradient checkpointing: off (chosen: micro-batches of 64 x 296 tokens")
    assert "trainer.gradient_checkpointing=true overrides" in line

    # four times the micro-batch does not fit: checkpointing stays on, and the line says how to force it off
    chosen, line = memory_plan.choose(_cfg(qwen_1_5b, "trainer.per_device_train_batch_size=256"), longest_prompt=40)
    assert chosen == {"gradient_checkpointing": True}
    assert line.startswith("gradient checkpointing: on (chosen: micro-batches of 256 x 296 tokens")
    assert "trainer.gradient_checkpointing=false overrides" in line


def test_sleep_mode_hands_training_the_engine_share(qwen_1_5b, monkeypatch):
    cfg = _cfg(qwen_1_5b, "trainer.per_device_train_batch_size=96")
    _on_an_h200(monkeypatch, share=0.7)
    assert memory_plan.choose(cfg, longest_prompt=40)[0] == {"gradient_checkpointing": True}
    _on_an_h200(monkeypatch, share=None)  # what budget_bytes gives with vllm_enable_sleep_mode
    assert memory_plan.choose(cfg, longest_prompt=40)[0] == {"gradient_checkpointing": False}


def test_the_users_setting_and_auto_memory_off_choose_nothing(qwen_1_5b, monkeypatch):
    _on_an_h200(monkeypatch)
    for overrides in (
        ["trainer.gradient_checkpointing=true"],
        ["trainer.gradient_checkpointing=false", "trainer.per_device_train_batch_size=1024"],
        ["trainer.gradient_checkpointing=false", "run.auto_memory=false"],
        ["run.auto_memory=false"],
    ):
        assert memory_plan.choose(_cfg(qwen_1_5b, *overrides), longest_prompt=40)[0] == {}, overrides
    assert memory_plan.choose(_cfg(qwen_1_5b, "run.auto_memory=false"), longest_prompt=40) == ({}, None)


@pytest.mark.parametrize("auto_memory", ["true", "false"])
def test_the_users_setting_gets_a_start_line_saying_it_is_in_force(qwen_1_5b, monkeypatch, auto_memory):
    _on_an_h200(monkeypatch)
    for value, state in (("true", "on"), ("false", "off")):
        cfg = _cfg(qwen_1_5b, f"trainer.gradient_checkpointing={value}", f"run.auto_memory={auto_memory}")
        assert memory_plan.choose(cfg, longest_prompt=40)[1] == (
            f"gradient checkpointing: {state} (given: trainer.gradient_checkpointing={value}; run.auto_memory "
            "chooses only where it is unset)"
        )


def test_sharding_and_adapters_shrink_the_state(qwen_1_5b, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    need = {
        name: memory_plan.training_need(_cfg(qwen_1_5b, *overrides), QWEN_1_5B, longest_prompt=40)
        for name, overrides in {
            "ddp": [],
            "zero3": ["parallelism=zero3"],
            "zero3_offload": ["parallelism=zero3_offload"],
            "lora": ["peft=lora"],
        }.items()
    }
    params = memory_plan._parameters(1536, 8960, 28, 256, 151936)
    assert need["ddp"].state == 8 * params  # bf16 weights, gradients and AdamW's two moments, unsharded
    assert need["zero3"].state == 16 * params / 8  # float32 master copy and state, over 8 ranks
    assert need["zero3_offload"].state == 4 * params / 8
    assert need["lora"].state == 2 * params
    assert len({n.activations for n in need.values()}) == 1, "the micro-batch's activations do not shard"


def test_without_the_models_config_checkpointing_stays_on(tmp_path, monkeypatch):
    _on_an_h200(monkeypatch)
    cfg = _cfg(tmp_path / "nowhere")
    chosen, line = memory_plan.choose(cfg, longest_prompt=40)
    assert chosen == {"gradient_checkpointing": True} and "config.json is not on this machine" in line


def test_on_cpu_the_budget_is_the_hosts_memory_beside_the_kv_cache(qwen_1_5b):
    import psutil

    budget, where = memory_plan.budget_bytes(_cfg(qwen_1_5b, "run.cpu_kvcache_gb=2"))
    assert abs(budget - (psutil.virtual_memory().available - 2 * GIB)) < 1 * GIB
    assert where == "GiB of host memory available beside vLLM's KV cache"


def test_on_a_gpu_the_budget_is_the_gpu_less_the_engine_share_unless_it_sleeps(qwen_1_5b, monkeypatch):
    import torch  # no GPU here: its two answers stand in for one H200 (the GPU runs log the real budget)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": H200})())
    assert memory_plan.budget_bytes(_cfg(qwen_1_5b, "trainer.vllm_gpu_memory_utilization=0.3")) == (
        pytest.approx(0.7 * H200),
        "GiB on the GPU beside vLLM's 0.3 share",
    )
    assert memory_plan.budget_bytes(_cfg(qwen_1_5b, "placement=colocate_sleep")) == (H200, "GiB on the GPU")
