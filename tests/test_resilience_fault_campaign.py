"""The fault campaign's checks (colocated_grpo/bench/fault_campaign.py), on synthetic run files: each must pass a
good run and catch a bad one. The campaign itself is a script, run by hand (docs/resilience.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from colocated_grpo.bench import fault_campaign as fc


def _metrics(run_dir: Path, steps: list[int]) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"train/global_step": s}) + "\n" for s in steps))


def test_steps_each_once_in_order(tmp_path):
    _metrics(tmp_path, [1, 2, 3, 4])
    assert fc.check_steps(tmp_path, 4) == (True, "steps 1..4, each once")
    _metrics(tmp_path, [1, 2, 3, 3, 4])
    ok, detail = fc.check_steps(tmp_path, 4)
    assert not ok and "repeated [3]" in detail
    _metrics(tmp_path, [1, 2, 4])
    ok, detail = fc.check_steps(tmp_path, 4)
    assert not ok and "missing [3]" in detail


def test_attempts_listed_with_the_status_their_stop_implies(tmp_path):
    attempts = [
        fc.Attempt(1, "SIGKILL", "startup", hit="startup", recorded=False),
        fc.Attempt(2, "SIGKILL", "save", hit="save", recorded=True, steps_after=4),
        fc.Attempt(3, "SIGTERM", "step", hit="step", recorded=True, steps_after=6),
        fc.Attempt(4, "SIGINT", "startup", hit="startup", recorded=False, steps_before=6, steps_after=6),
        fc.Attempt(5, None, None, hit="ran to the end", recorded=True, steps_before=6, steps_after=8),
    ]
    listed = [{"status": "died"}, {"status": "interrupted"}, {"status": "finished"}]
    (tmp_path / "run.json").write_text(json.dumps({"attempts": listed}))
    ok, detail = fc.check_attempts(tmp_path, attempts)
    assert ok and "2 stopped in start-up before recording" in detail, detail
    assert [a.status for a in attempts] == [None, "died", "interrupted", None, "finished"]
    attempts[3].steps_after = 7  # trained a step, yet never recorded itself
    ok, detail = fc.check_attempts(tmp_path, attempts)
    assert not ok and "attempt 4 (SIGINT at startup) trained steps but is not in run.json" in detail
    attempts[3].steps_after = 6

    listed[1]["status"] = "died"  # a SIGTERM that did not stop the run cleanly
    (tmp_path / "run.json").write_text(json.dumps({"attempts": listed}))
    ok, detail = fc.check_attempts(tmp_path, attempts)
    assert not ok and "attempt 3 (SIGTERM): status died" in detail
    ok, detail = fc.check_attempts(tmp_path, [*attempts, fc.Attempt(5, None, None, recorded=True)])
    assert not ok and "run.json lists 3 attempts, 4 recorded themselves" in detail


def _wandb_run(run_dir: Path, steps: list[int]) -> None:
    import wandb

    run_dir.mkdir()
    run = wandb.init(project="t", dir=str(run_dir), mode="offline")
    for step in steps:
        run.log({"train/loss": 0.5, "train/global_step": step})
        run.log({"profiling/other": 1.0})  # rows without a loss (TRL's profiling) are not steps
    run.finish()
    wandb.teardown()
    (run_dir / "run.json").write_text(json.dumps({"wandb_id": run.id}))


def test_wandb_run_each_step_once(tmp_path):
    _wandb_run(tmp_path / "good", [1, 2, 3])
    ok, detail = fc.check_wandb(tmp_path / "good", 3)
    assert ok and detail.endswith("1 segments, steps 1..3 each once"), detail
    _wandb_run(tmp_path / "bad", [1, 2, 3, 3])  # step 3 logged twice: what a missed rewind would leave
    ok, detail = fc.check_wandb(tmp_path / "bad", 3)
    assert not ok and "step rows [1, 2, 3, 3]" in detail


def test_leftover_processes_are_found_by_group_and_by_run_dir(tmp_path):
    marker = str(tmp_path / "run")
    child = "import time; print('started', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", child, marker], start_new_session=True, stdout=subprocess.PIPE)
    proc.stdout.readline()  # its command line is the marker's once it runs, not the forked test's before its exec
    try:
        assert any(line.startswith(f"{proc.pid} ") for line in fc.leftover_processes([proc.pid], "unrelated"))
        assert any(line.startswith(f"{proc.pid} ") for line in fc.leftover_processes([], marker))
    finally:
        proc.kill()
        proc.wait()
    assert fc.leftover_processes([proc.pid], marker) == []


def test_fault_plan_uses_every_signal_and_moment_and_follows_the_seed():
    plan = fc.plan_faults(5, seed=0)
    assert len(plan) == 5 and plan == fc.plan_faults(5, seed=0) and plan != fc.plan_faults(5, seed=1)
    assert {s for s, _ in plan} == set(fc.SIGNALS) and {m for _, m in plan} == set(fc.MOMENTS)


def test_after_a_kill_before_the_first_checkpoint_the_next_attempt_starts_over_by_choice(tmp_path):
    assert fc.resume_choice(tmp_path) == [], "a run that has not started yet"
    _metrics(tmp_path, [1, 2])
    (tmp_path / "checkpoint-2").mkdir()  # written but never marked complete
    assert fc.resume_choice(tmp_path) == ["run.resume=restart"]
    (tmp_path / "checkpoint-2" / "complete.json").write_text(json.dumps({"global_step": 2, "ranks": 1}))
    (tmp_path / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    assert fc.resume_choice(tmp_path) == [], "a complete checkpoint: resumed as usual"
