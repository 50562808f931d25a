"""Gradient checkpointing is chosen from memory before the model loads (training.memory_plan): off where a
micro-batch's activations fit beside the engine's share, on where not, never against the user's own setting. The plan
counts what TRL holds, term by term, against the GPU's free memory, and its estimate is what run.json records."""

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
PARAMS = memory_plan._parameters(1536, 8960, 28, 256, 151936)
LAYER = memory_plan._parameters(1536, 8960, 1, 256, 0)


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


def _need(model_dir, *overrides, longest_prompt=40):
    return memory_plan.training_need(_cfg(model_dir, *overrides), QWEN_1_5B, longest_prompt=longest_prompt)


def _on_an_h200(monkeypatch, share: float | None = 0.3, free: float = H200):
    engine = share * H200 if share else 0.0
    monkeypatch.setattr(
        memory_plan, "budget_bytes", lambda cfg: memory_plan.Budget(free, engine, "GiB on the GPU", "gpu")
    )


def _a_gpu(monkeypatch, free: float, total: float = H200):
    """torch's two answers for one GPU (there is none here); mem_get_info is all the plan asks of it."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))


def test_the_parameters_of_a_shape_are_the_published_count():
    shape = QWEN_1_5B
    count = memory_plan._parameters(shape["hidden_size"], shape["intermediate_size"], 28, 256, shape["vocab_size"])
    assert abs(count - 1.54e9) / 1.54e9 < 0.01  # Qwen2.5-1.5B: 1.54e9 parameters (tied embeddings)


def test_an_lm_head_of_its_own_is_counted_where_the_embeddings_are_not_tied(tmp_path):
    """Qwen2.5-7B (published config.json, tie_word_embeddings false: 7.62e9 parameters) with only its config on disk:
    its LM head's 545 million parameters are state too, about 4 GiB in bf16 with AdamW's moments and gradients."""
    qwen_7b = {
        **QWEN_1_5B,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    }
    (tmp_path / "qwen_7b").mkdir()
    (tmp_path / "qwen_7b" / "config.json").write_text(json.dumps(qwen_7b))
    cfg = _cfg(tmp_path / "qwen_7b")
    untied = memory_plan.training_need(cfg, qwen_7b, longest_prompt=40)
    tied = memory_plan.training_need(cfg, {**qwen_7b, "tie_word_embeddings": True}, longest_prompt=40)
    assert abs(memory_plan._parameters(3584, 18944, 28, 512, 152064, tied=False) - 7.62e9) / 7.62e9 < 0.01
    assert untied.state - tied.state == 152064 * 3584 * 4 * 2  # weights, gradients and two moments in bf16


def test_checkpointing_goes_off_where_the_micro_batch_fits_beside_the_engine(qwen_1_5b, monkeypatch):
    _on_an_h200(monkeypatch, share=0.3)
    plan = memory_plan.choose(_cfg(qwen_1_5b, "trainer.per_device_train_batch_size=64"), longest_prompt=40)
    assert plan.chosen == {"gradient_checkpointing": False}
    assert plan.line.startswith("gradient checkpointing: off (chosen: micro-batches of 64 x 296 tokens")
    assert "trainer.gradient_checkpointing=true overrides" in plan.line

    # four times the micro-batch does not fit: checkpointing stays on, and the line says how to force it off
    plan = memory_plan.choose(_cfg(qwen_1_5b, "trainer.per_device_train_batch_size=256"), longest_prompt=40)
    assert plan.chosen == {"gradient_checkpointing": True}
    assert plan.line.startswith("gradient checkpointing: on (chosen: micro-batches of 256 x 296 tokens")
    assert "trainer.gradient_checkpointing=false overrides" in plan.line


def test_sleep_mode_hands_training_the_engine_share(qwen_1_5b, monkeypatch):
    cfg = _cfg(qwen_1_5b, "trainer.per_device_train_batch_size=96")
    _on_an_h200(monkeypatch, share=0.7)
    assert memory_plan.choose(cfg, longest_prompt=40).chosen == {"gradient_checkpointing": True}
    _on_an_h200(monkeypatch, share=None)  # what budget_bytes gives with vllm_enable_sleep_mode
    assert memory_plan.choose(cfg, longest_prompt=40).chosen == {"gradient_checkpointing": False}


def test_the_users_setting_and_auto_memory_off_choose_nothing(qwen_1_5b, monkeypatch):
    _on_an_h200(monkeypatch)
    for overrides in (
        ["trainer.gradient_checkpointing=true"],
        ["trainer.gradient_checkpointing=false", "trainer.per_device_train_batch_size=1024"],
        ["trainer.gradient_checkpointing=false", "run.auto_memory=false"],
        ["run.auto_memory=false"],
    ):
        assert memory_plan.choose(_cfg(qwen_1_5b, *overrides), longest_prompt=40).chosen == {}, overrides
    assert memory_plan.choose(_cfg(qwen_1_5b, "run.auto_memory=false"), longest_prompt=40) == memory_plan.Plan(
        {}, None, None
    )


@pytest.mark.parametrize("auto_memory", ["true", "false"])
def test_the_users_setting_gets_a_start_line_saying_it_is_in_force_with_the_estimate(
    qwen_1_5b, monkeypatch, auto_memory
):
    _on_an_h200(monkeypatch)
    for value, state in (("true", "on"), ("false", "off")):
        cfg = _cfg(qwen_1_5b, f"trainer.gradient_checkpointing={value}", f"run.auto_memory={auto_memory}")
        plan = memory_plan.choose(cfg, longest_prompt=40)
        assert plan.line.startswith(
            f"gradient checkpointing: {state} (given: trainer.gradient_checkpointing={value}; run.auto_memory "
            "chooses only where it is unset); training estimated at ~"
        )
        assert plan.record["gradient_checkpointing"] is (value == "true")
        assert plan.record["decided_by"] == "trainer.gradient_checkpointing"


def test_sharding_and_adapters_shrink_the_state(qwen_1_5b, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    need = {
        name: _need(qwen_1_5b, *overrides)
        for name, overrides in {
            "ddp": [],
            "zero3": ["parallelism=zero3"],
            "zero3_offload": ["parallelism=zero3_offload"],
            "lora": ["peft=lora"],
        }.items()
    }
    assert need["ddp"].state == 8 * PARAMS  # bf16 weights, gradients and AdamW's two moments, unsharded
    assert need["zero3"].state == 16 * PARAMS / 8  # float32 master copy and state, over 8 ranks
    assert need["zero3_offload"].state == 4 * PARAMS / 8
    assert need["lora"].state == 2 * PARAMS
    assert len({n.activations for n in need.values()}) == 1, "the micro-batch's activations do not shard"


def test_the_lm_head_is_one_chunk_of_logits_not_the_whole_completion(qwen_1_5b, monkeypatch):
    """TRL's chunked head holds one [4096, 32768] tile of logits and float32 gradients of the hidden states it scores
    and of its weight; 64 completions of 256 tokens over 151,936 tokens would be 9.3 GiB of float32 logits."""
    monkeypatch.setattr(memory_plan, "_triton_device", lambda: True)  # a GPU: only completion tokens are scored
    head = _need(qwen_1_5b, "trainer.per_device_train_batch_size=64").lm_head
    scored = 64 * 256
    assert head == 4096 * 32768 * 2 + scored * 1536 * 4 + 151936 * 1536 * 4
    assert head < 64 * 256 * 151936 * 4 / 7
    # the tile in float32 where the head runs in float32; a frozen head (adapters) has no weight gradient
    assert _need(qwen_1_5b, "trainer.per_device_train_batch_size=64", "trainer.cast_lm_head_to_fp32=true").lm_head == (
        head + 4096 * 32768 * 2
    )
    assert _need(qwen_1_5b, "trainer.per_device_train_batch_size=64", "peft=lora").lm_head == head - 151936 * 1536 * 4
    # a micro-batch smaller than one tile holds only its own tokens' logits
    small = _need(qwen_1_5b, "trainer.per_device_train_batch_size=1", "trainer.max_completion_length=64").lm_head
    assert small == 64 * 32768 * 2 + 64 * 1536 * 4 + 151936 * 1536 * 4


def test_the_estimate_of_the_measured_h200_run_is_within_5_percent_of_what_training_held(qwen_1_5b, monkeypatch):
    """docs/results.md: 1.5B, micro-batches of 64 x 317 tokens, one H200 beside vLLM's 0.3 share: training held about
    74 GiB (the GPU's peak less the engine's share). Charging the whole completion's logits said 80.9 GiB."""
    monkeypatch.setattr(memory_plan, "_triton_device", lambda: True)
    need = _need(qwen_1_5b, "trainer.per_device_train_batch_size=64", longest_prompt=61)
    assert abs(need.without_checkpointing / GIB - 74) / 74 < 0.05, need.without_checkpointing / GIB


def test_a_reference_model_is_counted_where_beta_is_not_zero_and_no_adapter_stands_in(qwen_1_5b, monkeypatch):
    assert _need(qwen_1_5b, "trainer.beta=0.0").reference == 0
    assert _need(qwen_1_5b, "trainer.beta=0.04").reference == 2 * PARAMS  # a bf16 copy of the weights
    assert _need(qwen_1_5b, "trainer.beta=0.04", "peft=lora").reference == 0  # TRL disables the adapters instead
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert _need(qwen_1_5b, "trainer.beta=0.04", "parallelism=zero3").reference == 2 * PARAMS / 8  # sharded as well

    # it decides: a micro-batch that fits beside the engine without a reference model does not with one
    _on_an_h200(monkeypatch, share=0.3)
    monkeypatch.delenv("WORLD_SIZE")
    batch = "trainer.per_device_train_batch_size=84"
    assert memory_plan.choose(_cfg(qwen_1_5b, batch), 40).chosen == {"gradient_checkpointing": False}
    assert memory_plan.choose(_cfg(qwen_1_5b, batch, "trainer.beta=0.04"), 40).chosen == {
        "gradient_checkpointing": True
    }


def test_ddp_buckets_hold_one_more_gradient_set_when_there_is_more_than_one_process(qwen_1_5b, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert _need(qwen_1_5b).ddp_buckets == 0  # one process: no DDP
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _need(qwen_1_5b).ddp_buckets == 2 * PARAMS  # bf16 gradients, copied into the reducer's buckets
    assert _need(qwen_1_5b, "peft=lora").ddp_buckets == 0  # only the adapters' small gradients
    for sharded in ("parallelism=zero3", "parallelism=fsdp"):
        assert _need(qwen_1_5b, sharded).ddp_buckets == 0, sharded


def test_zero3_and_fsdp_count_their_gathered_parameters_and_buckets(qwen_1_5b, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    embedding = 151936 * 1536  # larger than a decoder layer: the module ZeRO-3 gathers whole at most
    assert embedding > LAYER
    assert _need(qwen_1_5b).sharding == 0
    assert _need(qwen_1_5b, "parallelism=zero3").sharding == (embedding + 5e7 + 5e8) * 2  # DeepSpeed's default buckets
    auto = ("+trainer.deepspeed.zero_optimization.reduce_bucket_size=auto",)
    assert _need(qwen_1_5b, "parallelism=zero3", *auto).sharding == (embedding + 5e7 + 1536 * 1536) * 2
    assert _need(qwen_1_5b, "parallelism=fsdp").sharding == (3 * LAYER + embedding) * 2


def test_the_gpu_budget_is_its_free_memory_less_the_engine_share_unless_it_sleeps(qwen_1_5b, monkeypatch):
    _a_gpu(monkeypatch, free=H200)
    budget = memory_plan.budget_bytes(_cfg(qwen_1_5b, "trainer.vllm_gpu_memory_utilization=0.3"))
    assert budget.bytes == pytest.approx(0.7 * H200)
    assert budget.where == "GiB free on the GPU beside vLLM's 0.3 share"
    assert memory_plan.budget_bytes(_cfg(qwen_1_5b, "placement=colocate_sleep")).bytes == H200

    # another process holds 40 GiB: the engine still takes its share of the total, training gets less
    _a_gpu(monkeypatch, free=H200 - 40 * GIB)
    budget = memory_plan.budget_bytes(_cfg(qwen_1_5b, "trainer.vllm_gpu_memory_utilization=0.3"))
    assert budget.bytes == pytest.approx(0.7 * H200 - 40 * GIB)
    assert budget.where == "GiB free on the GPU (40.0 GiB held by other processes) beside vLLM's 0.3 share"
    assert memory_plan.budget_bytes(_cfg(qwen_1_5b, "placement=colocate_sleep")).bytes == H200 - 40 * GIB


def test_memory_other_processes_hold_turns_checkpointing_back_on(qwen_1_5b, monkeypatch):
    cfg = _cfg(qwen_1_5b, "trainer.per_device_train_batch_size=64")
    _a_gpu(monkeypatch, free=H200)
    assert memory_plan.choose(cfg, longest_prompt=40).chosen == {"gradient_checkpointing": False}
    _a_gpu(monkeypatch, free=H200 - 40 * GIB)
    plan = memory_plan.choose(cfg, longest_prompt=40)
    assert plan.chosen == {"gradient_checkpointing": True}
    assert "(40.0 GiB held by other processes)" in plan.line


def test_the_record_holds_the_estimate_in_force_term_by_term_and_the_budget(qwen_1_5b, monkeypatch):
    _a_gpu(monkeypatch, free=H200 - 40 * GIB)
    for batch, checkpointing in ((8, False), (64, True)):
        plan = memory_plan.choose(_cfg(qwen_1_5b, f"trainer.per_device_train_batch_size={batch}"), 40)
        record = plan.record
        assert record["gradient_checkpointing"] is checkpointing is plan.chosen["gradient_checkpointing"]
        assert record["decided_by"] == "run.auto_memory" and record["device"] == "gpu"
        assert set(record["terms_gib"]) == {
            "weights_gradients_optimizer",
            "activations",
            "lm_head_chunk",
            "reference_model",
            "ddp_buckets",
            "sharding_buffers",
        }
        assert record["estimate_gib"] == pytest.approx(sum(record["terms_gib"].values()), abs=0.01)
        assert (record["estimate_gib"] < record["without_checkpointing_gib"]) is checkpointing
        assert record["free_gib"] == pytest.approx((H200 - 40 * GIB) / GIB, abs=0.001)
        assert record["engine_gib"] == pytest.approx(0.3 * H200 / GIB, abs=0.001)
        assert record["budget_gib"] == pytest.approx(record["free_gib"] - record["engine_gib"], abs=0.002)
        assert record["micro_batch"] == batch and record["sequence_tokens"] == 296


def test_without_the_models_config_checkpointing_stays_on(tmp_path, monkeypatch):
    _on_an_h200(monkeypatch)
    plan = memory_plan.choose(_cfg(tmp_path / "nowhere"), longest_prompt=40)
    assert plan.chosen == {"gradient_checkpointing": True} and "config.json is not on this machine" in plan.line
    assert plan.record is None


def test_on_cpu_the_budget_is_the_hosts_memory_beside_the_kv_cache(qwen_1_5b):
    import psutil

    budget = memory_plan.budget_bytes(_cfg(qwen_1_5b, "run.cpu_kvcache_gb=2"))
    assert abs(budget.bytes - (psutil.virtual_memory().available - 2 * GIB)) < 1 * GIB
    assert budget.engine == 2 * GIB and budget.device == "host"
    assert budget.where == "GiB of host memory available beside vLLM's KV cache"


def test_the_peak_joins_the_estimate_from_this_attempts_steps(tmp_path, monkeypatch):
    record = {"estimate_gib": 1.0}
    assert memory_plan.with_peak(None, tmp_path, 0) is None  # no plan, nothing to check
    on_cpu = memory_plan.with_peak(record, tmp_path, 0)
    assert on_cpu["peak_of"] == "host (this process's peak resident memory)" and on_cpu["peak_gib"] > 0.05

    _a_gpu(monkeypatch, free=H200)
    rows = [{"train/global_step": 1, "memory/peak_gb": 90.0}, {"train/global_step": 3, "memory/peak_gb": 80.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, {"train/global_step": 4}]))
    resumed = memory_plan.with_peak(record, tmp_path, from_step=2)  # step 1 belongs to an earlier attempt
    assert resumed == {"estimate_gib": 1.0, "peak_gib": round(80e9 / GIB, 3), "peak_of": "gpu (NVML)"}
    assert memory_plan.with_peak(record, tmp_path, from_step=0)["peak_gib"] == round(90e9 / GIB, 3)
