"""Server placement: planning, health checks and teardown against real local processes.

What cannot run on CPU: TRL's weight sync to a vLLM server needs NCCL and a CUDA device
(trl VLLMClient.init_communicator raises NotImplementedError otherwise), so server-mode training itself runs
only on the GPU machine."""

import signal
import subprocess
import sys
import time

import pytest
from conftest import assert_stops_with_its_parent
from omegaconf import OmegaConf

from colocated_grpo.launch import processes
from colocated_grpo.launch import server_placement as server
from colocated_grpo.training.config import ConfigError

GPUS = ["GPU-a", "GPU-b", "GPU-c", "GPU-d"]


def placement(**kw):
    p = {
        "name": "server",
        "server_gpus": 1,
        "server_tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.9,
        "port": None,
        "group_port": None,
        "health_timeout_s": 30,
    } | kw
    return OmegaConf.create({"placement": p, "trainer": {"vllm_max_model_length": 256}, "model": {"dtype": "bfloat16"}})


def test_last_k_gpus_serve_and_the_rest_train():
    plan = server.plan(placement(server_gpus=2, server_tensor_parallel_size=2), GPUS)
    assert plan.train_gpus == ["GPU-a", "GPU-b"] and plan.server_gpus == ["GPU-c", "GPU-d"] and plan.nproc == 2
    assert plan.port != plan.group_port and not processes.port_in_use(plan.port)


def test_two_plans_get_different_ports():
    a, b = server.plan(placement(), GPUS), server.plan(placement(), GPUS)
    assert len({a.port, a.group_port, b.port, b.group_port}) >= 3


@pytest.mark.parametrize("k", [4, 5, 0])
def test_server_must_leave_gpus_for_training(k):
    with pytest.raises(
        ConfigError, match=f"placement.server_gpus={k} must be at least 1 and leave at least one of the 4"
    ):
        server.plan(placement(server_gpus=k), GPUS)


def test_server_tp_must_divide_server_gpus():
    with pytest.raises(
        ConfigError, match=r"placement\.server_tensor_parallel_size=2 must divide placement\.server_gpus=3"
    ):
        server.plan(placement(server_gpus=3, server_tensor_parallel_size=2), GPUS)


def test_port_in_use_is_refused_before_launch():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"placement.port={port} is in use"):
            server.plan(placement(port=port), GPUS)


def test_server_command_splits_engines_by_tp():
    plan = server.ServerPlan(["GPU-a"], ["GPU-b", "GPU-c"], 8000, 51216)
    cmd = server.server_command(placement(server_gpus=2), "/models/m", plan)
    assert cmd[1:4] == ["-m", "trl.cli.main", "vllm-serve"]
    args = dict(zip(cmd[4::2], cmd[5::2], strict=True))
    assert args["--data_parallel_size"] == "2" and args["--tensor_parallel_size"] == "1" and args["--port"] == "8000"
    assert args["--max_model_len"] == "256" and args["--gpu_memory_utilization"] == "0.9"


def test_cpu_only_machine_gets_a_clear_error(monkeypatch):
    pytest.importorskip("pynvml")
    if _has_nvml():
        pytest.skip("this machine has NVIDIA GPUs")
    with pytest.raises(ConfigError, match="placement=server needs NVIDIA GPUs"):
        server.visible_gpus()


def _has_nvml():
    import pynvml

    try:
        pynvml.nvmlInit()
        return True
    except pynvml.NVMLError:
        return False


def test_healthy_server_is_detected(tmp_path):
    (tmp_path / "health").write_text("ok")
    port = processes.free_port()
    proc = processes.start(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(tmp_path)],
        tmp_path / "server.log",
    )
    try:
        waited = server.wait_until_healthy(f"http://127.0.0.1:{port}/health", proc, 30, tmp_path / "server.log")
        assert waited < 30
    finally:
        processes.stop(proc)
    assert proc.poll() is not None


def test_server_that_dies_is_reported_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    proc = processes.start(
        [sys.executable, "-c", "print('CUDA out of memory while loading'); raise SystemExit(3)"], log
    )
    with pytest.raises(server.ServerError, match=r"exited with code 3 before it was healthy(.|\n)*CUDA out of memory"):
        server.wait_until_healthy(f"http://127.0.0.1:{processes.free_port()}/health", proc, 30, log)


def test_server_that_never_answers_times_out(tmp_path):
    log = tmp_path / "server.log"
    proc = processes.start([sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"], log)
    try:
        t0 = time.monotonic()
        with pytest.raises(server.ServerError, match=r"not healthy after 2s(.|\n)*loading"):
            server.wait_until_healthy(f"http://127.0.0.1:{processes.free_port()}/health", proc, 2, log)
        assert time.monotonic() - t0 < 10
    finally:
        processes.stop(proc, grace_s=1)


def test_a_sweep_job_and_a_study_give_torchrun_their_grace(tmp_path):
    """torchrun kills its workers after its own shutdown timeout (30 s by default), whatever the caller waits: a
    sweep job's torchrun gets the sweep's grace, and a study gives its sweeps its own."""
    from colocated_grpo.bench.study import definition

    show = [sys.executable, "-c", "import os; print(os.environ['TORCH_ELASTIC_SHUTDOWN_TIMEOUT'])"]
    assert processes.run(show, tmp_path / "log", {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30"}, grace_s=44.5) == 0
    assert (tmp_path / "log").read_text().split() == ["45"]
    study = {"kinds": {"a": "ours"}, "common": [], "cases": {"a": []}}
    assert "hydra.launcher.stop_grace_s=60" in definition.case_command(study, "m", "a", tmp_path)


# A parent with a thread of its own (as a sweep's progress bar), starting a child and then killed by SIGKILL.
PARENT = """
import sys, threading, time
from pathlib import Path
from colocated_grpo.launch import processes
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
child = processes.start([sys.executable, "-c", "import time; time.sleep(600)"], Path(sys.argv[1]))
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_child_dies_with_its_parent_and_no_python_runs_between_fork_and_exec(tmp_path, monkeypatch):
    """PR_SET_PDEATHSIG is set by the child itself, in front of its command, not by a preexec_fn: that runs Python
    in the forked copy of a threaded parent, where a lock another thread held at the fork is never released."""
    import psutil

    started = []
    monkeypatch.setattr(processes.subprocess, "Popen", lambda *args, **kwargs: started.append(kwargs))
    processes.start(["true"], tmp_path / "log")
    assert started and started[0].get("preexec_fn") is None and started[0]["start_new_session"]
    monkeypatch.undo()

    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path / "child.log")], stdout=subprocess.PIPE)
    child = psutil.Process(int(parent.stdout.readline()))
    deadline = time.monotonic() + 10
    # /proc/<pid>/cmdline reads empty for a moment while the child execs
    while child.cmdline()[2:3] != ["import time; time.sleep(600)"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert child.cmdline() == [sys.executable, "-c", "import time; time.sleep(600)"], "its command, in its process"
    assert_stops_with_its_parent(child, parent)


def test_stop_takes_down_the_whole_process_group(tmp_path):
    # a parent that ignores SIGTERM and has two grandchildren, like torchrun with its workers
    script = (
        "import subprocess, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "[subprocess.Popen(['sleep', '300']) for _ in range(2)]; time.sleep(300)"
    )
    proc = processes.start([sys.executable, "-c", script], tmp_path / "log")
    deadline, children = time.monotonic() + 20, []
    while len(children) < 3 and time.monotonic() < deadline:  # wait for both grandchildren to start
        time.sleep(0.2)
        children = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 3
    t0 = time.monotonic()
    processes.stop(proc, grace_s=1)
    assert time.monotonic() - t0 < 5
    deadline = time.monotonic() + 10  # SIGKILL is delivered asynchronously; give the kernel a moment
    while time.monotonic() < deadline and any(_alive(pid) for pid in children):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in children)


def _alive(pid: int | str) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


# A trainer that saves for 3 s on SIGTERM and says so as the runner does, naming the command it was given.
FAKE_TRAINER = """
import os, signal, sys, time
def stop(signum, frame):
    time.sleep(3)
    print("training stopped by SIGTERM after step 3 of 30: checkpoint saved to RUN/checkpoint-3; run files flushed "
          "and W&B run finished. Resume with: " + os.environ["COLOCATED_GRPO_RESUME_COMMAND"], flush=True)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
print("step 1", flush=True)
time.sleep(120)
"""
# The orchestrator as train.py runs it (SIGTERM handled by signals.run_main, the exit as lifecycle.main takes it),
# with a local HTTP server for vLLM's and the script above for torchrun.
ORCHESTRATOR = """
import sys
from pathlib import Path
from omegaconf import OmegaConf
from colocated_grpo.launch import processes, server_placement as server
from colocated_grpo.resilience import process_end, signals
from colocated_grpo.resilience.signals import TrainingInterrupted
run_dir, trainer, served = map(Path, sys.argv[1:4])
NPROC = int(sys.argv[4])
server.server_command = lambda cfg, model, plan: [
    sys.executable, "-m", "http.server", str(plan.port), "--bind", "127.0.0.1", "-d", str(served)]
processes.train_command = lambda nproc, overrides: (
    [sys.executable, str(trainer)] if NPROC == 1 else processes.torchrun_command(NPROC, [], trainer))
cfg = OmegaConf.create({"placement": {"health_timeout_s": 30, "stop_grace_s": 20}})
plan = server.ServerPlan(["0"], ["1"], processes.free_port(), processes.free_port())
def main():
    try:
        server.launch(cfg, plan, run_dir, ["trainer.max_steps=30"], "model")
    except TrainingInterrupted as stopped:
        process_end.exit_now(stopped.code)
signals.run_main(main)
"""


def test_the_trainers_stop_line_is_found_behind_torchruns_traceback(tmp_path):
    """Under torchrun the ranks' stop lines are followed by torchrun's SignalException traceback, whose length depends
    on where the signal met its agent (30 lines in one run of the test below, more in others): the saved checkpoint is
    read from the stop line wherever the tail of the log puts it."""
    log = tmp_path / "trainer.log"
    stop = "training stopped by SIGTERM after step 3 of 30: checkpoint saved to RUN/checkpoint-3; run files flushed"
    frames = [f'  File "torch/distributed/elastic/agent/server/api.py", line {n}, in _invoke_run' for n in range(40)]
    log.write_text("\n".join(["step 1", stop, stop, "Traceback (most recent call last):", *frames]) + "\n")
    assert server.what_the_trainer_saved(log) == "SIGTERM after step 3 of 30: checkpoint saved to RUN/checkpoint-3"
    log.write_text("step 1\n" + "\n".join(frames) + "\n")
    assert server.what_the_trainer_saved(log) is None, "no stop line: none is made up"


@pytest.mark.parametrize("nproc", [1, 2], ids=["python", "torchrun"])
def test_sigterm_on_the_orchestrator_lets_the_trainer_save_and_exits_as_interrupted_with_a_one_server_resume(
    tmp_path, nproc
):
    """With two ranks the trainer is a real torchrun whose own shutdown timeout (1 s here, standing in for its 30 s
    default) is shorter than the save: the orchestrator's grace (placement.stop_grace_s) is the one that holds."""
    import os

    import psutil

    run_dir, served = tmp_path / "run", tmp_path / "served"
    run_dir.mkdir()
    served.mkdir()
    (served / "health").write_text("ok")
    trainer, orchestrator = tmp_path / "trainer.py", tmp_path / "orchestrate.py"
    trainer.write_text(FAKE_TRAINER)
    orchestrator.write_text(ORCHESTRATOR)
    proc = subprocess.Popen(
        [sys.executable, str(orchestrator), str(run_dir), str(trainer), str(served), str(nproc)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"},
    )
    deadline = time.monotonic() + 60
    log = run_dir / "trainer.log"  # every rank has its SIGTERM handler once it printed "step 1"
    while (not log.exists() or log.read_text().count("step 1") < nproc) and time.monotonic() < deadline:
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 2, "the server and the trainer run"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    resume = f"python {orchestrator} trainer.max_steps=30 hydra.run.dir={run_dir}"
    said = "server placement: SIGTERM received; the trainer stopped (exit 143) by SIGTERM after step 3 of 30: "
    assert said + f"checkpoint saved to RUN/checkpoint-3; the server stops too. Resume with: {resume}" in err
    assert "nothing trained" not in err and "start-up" not in err
    trainer_log = (run_dir / "trainer.log").read_text()
    assert trainer_log.count(f"Resume with: {resume}") == nproc, "every rank saved and names the same command"
    deadline = time.monotonic() + 10  # a child may still be exiting (or gone between two psutil calls)
    while time.monotonic() < deadline and any(_alive(c.pid) for c in children):
        time.sleep(0.1)
    assert not [c.pid for c in children if _alive(c.pid)], "nothing left"
