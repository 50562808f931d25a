"""What a run prints when it cannot start or fails. The run directory is checked and claimed before Hydra writes
into it: an unwritable `hydra.run.dir` is refused in one line, and a second launch into a directory in use is refused
without touching the live run's `.hydra/` record. A failure is printed once per launch, without the libraries' noise."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import Job, assert_stops_with_its_parent, run_bounded, run_environment
from test_resilience import FAULTY

from colocated_grpo.launch.processes import TRAIN_SCRIPT
from colocated_grpo.resilience import checkpoints, process_end, run_dir_guard


def _train(run_dir: str, model_cache: Path, cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(TRAIN_SCRIPT), f"hydra.run.dir={run_dir}", "logger=none", *overrides]
    env = run_environment(model_cache)
    return run_bounded(cmd, cwd=cwd, env=env, timeout=300)


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
    # a live run holding the directory (no engine needed); the test kills it when done
    live = Job(
        run_dir, model_cache, "trainer.max_steps=5000", "trainer.save_strategy=no", "logger=none", "placement=none"
    )
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
    monkeypatch.setattr(run_dir_guard, "_held", {})  # this test's claim alone, let go of at its end
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
        for lock in run_dir_guard._held.values():
            lock.release()
        os.environ.pop(run_dir_guard.HELD_ENV, None)


# ---------------------------------------------------------------------------------------------------------------
# What a run prints: a failure (resilience/process_end.py), not a resume's tied weights (resilience/checkpoints.py)


def test_a_missing_tied_weight_on_resume_is_not_reported_and_any_other_missing_key_is(caplog):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sizes = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    model = Qwen2ForCausalLM(Qwen2Config(**sizes, num_key_value_heads=1, tie_word_embeddings=True))
    logger = logging.getLogger("transformers.trainer")
    checkpoints.quiet_tied_weights_on_resume(model)
    try:
        with caplog.at_level(logging.WARNING, logger="transformers.trainer"):
            logger.warning("There were missing keys in the checkpoint model loaded: ['lm_head.weight'].")
            logger.warning("There were missing keys in the checkpoint model loaded: ['model.norm.weight'].")
        assert [r.getMessage() for r in caplog.records] == [
            "There were missing keys in the checkpoint model loaded: ['model.norm.weight']."
        ]
    finally:
        logger.filters.clear()


class _Explained(RuntimeError):
    pass


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_a_failure_is_printed_once_per_launch_with_its_traceback_in_the_log_file(tmp_path, monkeypatch, capsys):
    log_file = tmp_path / "train.log"
    handler = logging.FileHandler(log_file)
    logging.getLogger().addHandler(handler)
    try:
        # one process: the message alone for an error that explains itself, the traceback too for any other
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        monkeypatch.setenv("LOCAL_RANK", "0")  # left over in the environment: still no torchrun launch
        process_end.report_failure(_raised(_Explained("what to change")), explained=True)
        process_end.report_failure(_raised(KeyError("surprise")), explained=False)
        err = capsys.readouterr().err
        assert err.startswith("_Explained: what to change\nTraceback (most recent call last):")
        assert err.rstrip().endswith("KeyError: 'surprise'") and err.count("Traceback") == 1
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
        # two ranks of one torchrun launch (same parent) fail: the first to report says it, the other stays quiet
        monkeypatch.setattr(process_end, "OTHER_RANKS_WAIT_S", 1.0)
        claims = tmp_path / "claims"
        claims.mkdir()
        monkeypatch.setattr(process_end, "CLAIMS_DIR", claims)
        ended = subprocess.Popen([sys.executable, "-c", "pass"])  # the claim of a launch whose agent has ended
        stale = claims / f"colocated-grpo-failure-{ended.pid}-{psutil.Process(ended.pid).create_time():.0f}"
        ended.wait()
        stale.touch()
        error_file = tmp_path / "error.json"
        for rank in ("1", "0"):
            monkeypatch.setenv("LOCAL_RANK", rank)
            monkeypatch.setenv("RANK", rank)
            monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
            process_end.report_failure(_raised(_Explained(f"on rank {rank}")), explained=True)
        assert capsys.readouterr().err == "_Explained: on rank 1\n"
        reported = json.loads(error_file.read_text())["message"]
        assert reported["message"] == "_Explained: on rank 1"
        # stamped when rank 1 failed, before its wait: torchrun takes the earliest stamp (in seconds) for the root
        # cause, and a rank that failed after it and said nothing is stamped when torchrun saw it end
        assert int(reported["extraInfo"]["timestamp"]) <= time.time() - process_end.OTHER_RANKS_WAIT_S
        agent = psutil.Process(os.getppid())
        live = f"colocated-grpo-failure-{agent.pid}-{agent.create_time():.0f}-0"
        assert [p.name for p in claims.iterdir()] == [live], "the live launch's claim stays, the ended one's is gone"
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    logged = log_file.read_text()
    assert logged.count("Traceback (most recent call last)") == 4, "every failure's traceback is in the log file"


def test_a_failing_two_rank_run_prints_its_error_once_without_the_libraries_noise(model_cache, tmp_path):
    j = Job(
        tmp_path / "run",
        model_cache,
        *FAULTY,
        "+reward.weights.fails_on_odd_answer=1.0",
        "trainer.max_steps=3",
        "parallelism.nproc_per_node=2",
        "placement=none",  # both ranks fail in the reward, after generating: the engine plays no part
        nproc=2,
    )
    assert j.wait() != 0
    out = j.output
    said = [line for line in out.splitlines() if line.startswith("RewardError: reward 'fails_on_odd_answer'")]
    assert len(said) == 1, out[-6000:]
    root_cause = out.split("Root Cause (first observed failure)")[1]
    assert "traceback : RewardError: reward 'fails_on_odd_answer'" in root_cause, "torchrun names the error"
    assert 'in fails_on_odd_answer\n    raise ZeroDivisionError("odd answers are not handled")' in out, "user's frame"
    assert "nanobind" not in out and "Error executing job" not in out
    assert "Weave" not in out and "gradient_checkpointing` is deprecated" not in out
    assert "odd answers are not handled" in (j.dir / "train.log").read_text(), "the tracebacks are in the log file"
    assert [p.name for p in j.dir.iterdir() if p.name.startswith(".failure")] == [], "no claim left in the run dir"


# An "agent" that starts a "worker" in a session of its own, as torchrun does, and then waits.
AGENT = """
import os, subprocess, sys
worker = (
    "import os, sys, time; from colocated_grpo.resilience.signals import stop_with_torchrun_agent; "
    "stop_with_torchrun_agent(); print(os.getpid(), flush=True); time.sleep(60)"
)
env = {**os.environ, "TORCHELASTIC_RUN_ID": "test"}
proc = subprocess.Popen([sys.executable, "-c", worker], env=env, stdout=sys.stdout, start_new_session=True)
proc.wait()
"""


def test_a_worker_stops_when_its_torchrun_agent_is_killed():
    import psutil

    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True)
    assert_stops_with_its_parent(psutil.Process(int(agent.stdout.readline())), agent)


HANGS = """
import subprocess, sys, time
# a worker in a session of its own, as torchrun starts them, and a parent that waits on it for ever
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print("worker", worker.pid, flush=True)
print("last line before the hang", flush=True)
worker.wait()
"""


def test_a_test_process_that_hangs_is_killed_with_its_tree_and_fails_with_its_last_lines():
    """What every test that starts train.py, torchrun or a sweep runs through (conftest.run_bounded)."""
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failed:
        run_bounded([sys.executable, "-c", HANGS], timeout=3)
    assert time.monotonic() - start < 30
    message = str(failed.value)
    assert "ran past 3 s and was killed, with every process it started" in message
    assert "last line before the hang" in message
    worker = int(re.search(r"^worker (\d+)$", message, re.M)[1])
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
