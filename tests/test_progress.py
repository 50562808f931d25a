"""Progress of sweeps and studies: the running job's step read from its metrics.jsonl, the time left, and plain
lines (no control characters) when the output is not a terminal."""

from __future__ import annotations

import json
import time

import pytest

from colocated_grpo.launch import progress
from colocated_grpo.launch.progress import Progress, latest_step, run_step


def test_running_jobs_step_and_max_steps_come_from_its_run_files(tmp_path):
    assert run_step(tmp_path) == (None, None), "a job that has not started yet"
    (tmp_path / "config.yaml").write_text("trainer:\n  max_steps: 20\n")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"train/global_step": s, "loss": "x" * 3000}) + "\n" for s in range(1, 8)))
    with open(metrics, "a") as f:
        f.write('{"train/global_step": 8, "lo')  # a line being written
    assert run_step(tmp_path) == (7, 20)
    assert latest_step(tmp_path / "missing.jsonl") is None


def test_time_left_from_the_step_rate_then_from_finished_jobs(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock[0])
    p = Progress("sweep", 3)
    assert p.remaining_s() is None
    p._job_t0, p._step = 1000.0, (None, None)
    assert p.remaining_s() is None, "nothing to measure before the first step"
    clock[0], p._step = 1010.0, (2, 10)  # 5 s a step: 40 s left in this job, then 2 jobs of ~50 s
    assert p.remaining_s() == pytest.approx(40 + 2 * 50)
    p.durations, p.done, p._job_t0 = [60.0], 1, None
    assert p.remaining_s() == pytest.approx(2 * 60)
    p._job_t0, p._step = 1010.0, (None, None)  # the next job, 20 s in, step unknown: ~60 s a job
    clock[0] = 1030.0
    assert p.remaining_s() == pytest.approx(40 + 60)


def test_without_a_terminal_a_line_per_job_and_periodic_step_lines(tmp_path, capsys):
    lines = []
    (tmp_path / "config.yaml").write_text("trainer:\n  max_steps: 4\n")
    with Progress("sweep", 2, every_s=0.3, say=lines.append) as p:
        p.skip("#0 kept")
        with p.job("#1 tp=2", lambda: run_step(tmp_path)):
            (tmp_path / "metrics.jsonl").write_text('{"train/global_step": 3}\n')
            time.sleep(1.2)
    assert lines[0].startswith("[2/2] #1 tp=2: ") and "elapsed" in lines[0]
    steps = [line for line in lines[1:] if "step 3/4" in line]
    assert steps and all(line.startswith("    #1 tp=2: step 3/4; ") for line in steps)
    assert not any("\x1b" in line or "\r" in line for line in lines)
    assert capsys.readouterr().out == "", "lines go where the caller says (its log), nothing else is printed"


@pytest.mark.parametrize(("seconds", "text"), [(None, "?"), (42, "42s"), (125, "2m05s"), (3725, "1h02m")])
def test_durations_read_short(seconds, text):
    assert progress.duration(seconds) == text
