"""End to end on GPUs (run on a GPU machine: `pytest -m gpu`): DeepSpeed ZeRO-3 (with and without the optimizer
offloaded to CPU, and with sleep mode), LoRA adapters, and both together, with the colocated engine. In each, a
policy that moves every step keeps vLLM's sampling log-probs matching the trainer's only if the gathered (or
merged) weights reach the engine at every sync, and step 4, run without the sync, fails that check."""

import json

import pytest
import torch
from conftest import assert_weights_reach_the_engine, sync_off_from

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run with `pytest -m gpu`)"),
]

MOVING = (
    "trainer.learning_rate=0.02",
    "trainer.max_steps=4",
    "+reward.weights.even_token_share=1.0",
    "logger=none",
)
# Step 4 runs without the sync (tests/plugins/weight_sync_off.py), except beside sleep mode: sleep level 2 frees the
# engine's weights after each generation, so that without the sync it would generate from memory that holds none.
OFF_FROM = 4
# Adapter dropout would open a gap of its own (the engine has none): off, the gap measures the sync alone.
LORA = ("peft=lora", "peft.lora_dropout=0.0")


def _check(run, distributed_type: str | None, off_from: int | None = OFF_FROM) -> list[dict]:
    if distributed_type is not None:
        assert json.loads((run.dir / "run.json").read_text())["distributed_type"] == distributed_type
    assert "weight sync: TRL's own" in run.output, "ZeRO-3 and PEFT keep TRL's own sync"
    metrics = run.metrics()
    assert [m["train/global_step"] for m in metrics] == [1, 2, 3, 4]
    assert_weights_reach_the_engine(metrics, off_from)
    return metrics


@pytest.mark.parametrize(
    "overrides",
    [
        ("parallelism=zero3",),
        ("parallelism=zero3_offload",),
        ("parallelism=zero3_offload", "placement=colocate_sleep"),  # sleep mode beside the offloaded optimizer?
    ],
    ids=["zero3", "zero3_offload", "zero3_offload_sleep"],
)
def test_zero3_syncs_gathered_weights_to_the_engine(train, overrides):
    ranks = torch.cuda.device_count()
    off_from = None if "placement=colocate_sleep" in overrides else OFF_FROM
    run = train(*overrides, f"parallelism.nproc_per_node={ranks}", *MOVING, *sync_off_from(off_from), nproc=ranks)
    _check(run, "DEEPSPEED", off_from)
    assert (run.dir / "checkpoint-4" / "model.safetensors").exists()


@pytest.mark.parametrize("parallelism", ["ddp", "zero3"])
def test_lora_syncs_merged_weights_to_the_engine(train, parallelism):
    ranks = torch.cuda.device_count()
    overrides = (*LORA, f"parallelism={parallelism}", f"parallelism.nproc_per_node={ranks}", *MOVING)
    run = train(*overrides, *sync_off_from(OFF_FROM), nproc=ranks)
    _check(run, "DEEPSPEED" if parallelism == "zero3" else None)
    assert (run.dir / "checkpoint-4" / "adapter_model.safetensors").exists()


def test_lora_tensor_parallel_over_all_gpus(train):
    """TRL puts a barrier before a TP engine generates with PEFT (trl#3671): TP over every GPU exercises it."""
    ranks = torch.cuda.device_count()
    if ranks < 2:
        pytest.skip("needs 2 GPUs")
    run = train(
        *LORA,
        f"parallelism.nproc_per_node={ranks}",
        f"trainer.vllm_tensor_parallel_size={ranks}",
        *MOVING,
        *sync_off_from(OFF_FROM),
        nproc=ranks,
    )
    _check(run, None)
