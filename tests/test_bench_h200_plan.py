"""sweeps/studies/h200_plan.sh, the H200 calls still to make: its dry run plans every call through the study runner
on CPU, each switch beside the case it changes in one call at both length profiles (colocate_process beside colocate,
overlap beside colocate_process), speed_h200 one repeat of a block a call, in the study's order, and the GPU test
call; a call runs its study's steps, or `pytest -m gpu` on its test files, under timeout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from colocated_grpo.bench.study import definition as study
from colocated_grpo.bench.study import running
from colocated_grpo.provenance import REPO

PLAN = REPO / "sweeps" / "studies" / "h200_plan.sh"
SWITCHES = ("v2", "padded", "compile", "liger", "balanced", "process", "overlap")
AGAINST = {"overlap": "process"}  # a switch compared with another switch's case, not with the defaults
GPU_TESTS = {  # the GPU test calls: their test files and directories under OUT
    "engine_process_gpu": ("tests/test_engine_process_gpu.py", "gpu_tests/engine_process"),
    "packing_gpu": ("tests/test_training_packing_gpu.py", "gpu_tests/packing"),
}
RUNS_A_CALL = 4  # 80 to 150 s a run of 6 steps on one H200 (the kept studies' job.json): a call stays within 520 s
QUEUED = {  # the calls meant for a queue (longer than one call; a second call continues the directory): their steps
    "levers_realistic": ["realistic_256", "realistic_padded_256", "realistic_overlap_256"],
    "levers_cap": ["cap_256", "cap_overlap_256"],
    "levers_process": ["cap_process_256", "realistic_process_256"],
}


def _plan(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env}
    return subprocess.run(["bash", str(PLAN), *args], cwd=cwd, capture_output=True, text=True, timeout=120, env=env)


def _calls(out: str) -> dict[str, list[tuple[str, int]]]:
    """Each call of a dry run's output → the (case, repeat) steps it plans, in order (a GPU test call: its command)."""
    calls: dict[str, list] = {}
    for line in out.splitlines():
        if m := re.match(r"== (\w+): timeout (.*)", line):
            steps = calls[m[1]] = [m[2]] if " -m pytest " in line else []
        elif m := re.match(r"\[\d+/\d+\] \S+ (\w+) rep(\d+): ", line):
            steps.append((m[1], int(m[2])))
    return calls


def test_the_dry_run_plans_each_switch_beside_what_it_changes_the_speed_study_in_its_order_and_the_gpu_tests(tmp_path):
    done = _plan("--dry-run", str(tmp_path / "out"), cwd=tmp_path, PYTHON=sys.executable)
    assert done.returncode == 0, done.stderr
    planned = _calls(done.stdout)
    assert list(planned) == _plan(cwd=tmp_path).stdout.split(), "the calls it lists, in order"
    calls = dict(planned)
    for call, cases in QUEUED.items():
        assert calls.pop(call) == [(case, k) for k in (1, 2) for case in cases], "each repeat of all, then the next"
    assert max(len(steps) for steps in calls.values()) <= RUNS_A_CALL
    for call, (test, directory) in GPU_TESTS.items():
        assert calls.pop(call) == [
            f"--kill-after=60 520 {sys.executable} -m pytest -p no:cacheprovider -m gpu -n 0 {test} "
            f"--junitxml {tmp_path / 'out'}/{directory}/junit.xml"
        ]
    assert next(iter(planned)) == "engine_process_gpu", "the new placement's GPU path runs before it is measured"
    switches = study.load(REPO / "sweeps" / "studies" / "switches_h200.yaml")
    for switch in SWITCHES:
        for profile in ("cap", "realistic"):
            on = f"{profile}_{switch}_256"
            defaults = f"{profile}_{AGAINST[switch]}_256" if switch in AGAINST else f"{profile}_256"
            assert calls.pop(f"{switch}_{profile}") == [(defaults, 1), (on, 1), (defaults, 2), (on, 2)]
            also = [f"{profile}_256"] if switch in AGAINST else []  # and what a user gains over the defaults
            assert study.baselines(switches)[on] == [defaults, *also]
    assert {case for case in switches["cases"] if "_" in case.removesuffix("_256")} == {
        f"{profile}_{switch}_256" for switch in SWITCHES for profile in ("cap", "realistic")
    }, "every switch of the study has its calls"
    speed = study.load(REPO / "sweeps" / "studies" / "speed_h200.yaml")
    order = [(case, k) for _, _, case, k in running.plan(speed)]
    assert [step for steps in calls.values() for step in steps] == order, "each run once, in the study's order"
    assert all(len({k for _, k in steps}) == 1 for steps in calls.values()), "one repeat a call"
    assert {"ours_realistic_256", "plain_realistic_256", "plain_ours_realistic_256"} <= {case for case, _ in order}
    assert not (tmp_path / "out").exists(), "nothing ran"


def test_a_call_runs_its_steps_into_out_under_timeout(tmp_path):
    """Its study's `run` with its steps, into OUT (resolved where the call is made), stopped by timeout; a call it does
    not have is refused with the list."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "timeout").write_text('#!/bin/sh\necho timeout "$@"\n')
    (bin_dir / "timeout").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": "python3"}
    done = _plan("speed_realistic_rep2", "rel/out", cwd=tmp_path, **env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        *("timeout", "--kill-after=60", "520", "python3", "-m", "colocated_grpo.bench.study", "run"),
        *(str(REPO / "sweeps" / "studies" / "speed_h200.yaml"), "--out", str(tmp_path / "rel" / "out" / "speed_h200")),
        *("--only", "*/*_realistic_256/rep2"),
    ]
    refused = _plan("speed_realistic_rep4", "out", cwd=tmp_path, **env)
    assert refused.returncode == 2 and not refused.stdout
    assert "the calls: engine_process_gpu packing_gpu v2_cap" in refused.stderr
    gpu = _plan("engine_process_gpu", "rel/out", cwd=tmp_path, **env)
    assert gpu.returncode == 0, gpu.stderr
    assert gpu.stdout.split() == [
        *(
            "timeout",
            "--kill-after=60",
            "520",
            "python3",
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-m",
            "gpu",
            "-n",
            "0",
        ),
        str(REPO / "tests" / "test_engine_process_gpu.py"),
        *("--junitxml", str(tmp_path / "rel" / "out" / "gpu_tests" / "engine_process" / "junit.xml")),
    ]
    assert (tmp_path / "rel" / "out" / "gpu_tests" / "engine_process").is_dir(), "its report's directory"
