"""The run directory is checked and claimed before Hydra writes into it: an unwritable `hydra.run.dir` is refused in
one line, and a second launch into a directory in use is refused without touching the live run's `.hydra/` record."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_environment
from test_resilience import Job

from colocated_grpo.launch.processes import TRAIN_SCRIPT
from colocated_grpo.resilience import run_dir_guard


def _train(run_dir: str, model_cache: Path, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(TRAIN_SCRIPT), f"hydra.run.dir={run_dir}", "logger=none", *overrides]
    env = run_environment(model_cache)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("where", ["/proc/nope", "under_a_file"])
def test_an_unwritable_run_dir_fails_in_one_line_naming_hydra_run_dir(where, model_cache, tmp_path):
    if where == "under_a_file":
        (tmp_path / "a_file").write_text("")
        where, reason = str(tmp_path / "a_file" / "run"), f"{tmp_path / 'a_file'} is a file, not a directory"
    else:
        reason = "No such file or directory: /proc/nope"
    proc = _train(where, model_cache, tmp_path)
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    assert f"error: hydra.run.dir={where} cannot be used as the run directory: {reason}" in out, out
    assert "Traceback" not in out and out.strip().count("\n") == 0, "one line, no traceback"


def test_a_refused_second_run_leaves_the_live_runs_hydra_record_alone(model_cache, tmp_path):
    run_dir = tmp_path / "run"
    live = Job(run_dir, model_cache, "trainer.max_steps=50", "trainer.save_strategy=no", "logger=none")
    try:
        live.wait_until(lambda: (run_dir / "run.json").exists(), timeout=300)
        record = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        assert set(record) == {"config.yaml", "hydra.yaml", "overrides.yaml"}
        second = _train(str(run_dir), model_cache, tmp_path, "trainer.max_steps=7", "seed=3")
        out = second.stdout + second.stderr
        assert second.returncode == 1
        assert f"error: {run_dir} is in use by another training process" in out, out
        assert "Traceback" not in out
        assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == record
        assert live.proc.poll() is None, "the live run goes on"
    finally:
        live.signal_group(signal.SIGKILL)
        live.wait()


def test_claiming_is_idempotent_in_a_process_and_inherited_by_its_children(tmp_path, monkeypatch):
    monkeypatch.delenv(run_dir_guard.HELD_ENV, raising=False)
    run_dir = tmp_path / "run"
    run_dir_guard.check_writable(run_dir)
    try:
        run_dir_guard.claim(run_dir)  # again, from the runner: no-op
        child = "from colocated_grpo.resilience import run_dir_guard as g; import sys; g.claim(sys.argv[1])"
        held = subprocess.run([sys.executable, "-c", child, str(run_dir)], capture_output=True, text=True)
        assert held.returncode == 0, held.stderr  # started by the holder: inherits the claim
        env = {k: v for k, v in run_environment(tmp_path).items() if k != run_dir_guard.HELD_ENV}
        other = subprocess.run([sys.executable, "-c", child, str(run_dir)], capture_output=True, text=True, env=env)
        assert other.returncode != 0 and "is in use by another training process" in other.stderr
    finally:
        run_dir_guard.release_all()
