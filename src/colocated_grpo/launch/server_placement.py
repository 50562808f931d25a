"""Server placement: `trl vllm-serve` on the last K GPUs of the node, torchrun training on the others.

`python train.py placement=server` plans the GPUs and ports, starts the server, waits until it is healthy, runs the
trainer's torchrun against it and stops the server at the end, on failure and on Ctrl-C (each child in its own
process group). SIGTERM or Ctrl-C during training reaches the trainer, which saves within placement.stop_grace_s;
the orchestrator then exits as the trainer did, with the command that resumes the run with one server. The
trainer's rank 0 also samples the server's GPUs (their UUIDs in SERVER_GPUS_ENV)."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from colocated_grpo import run_files
from colocated_grpo.compat.hydra import task_overrides
from colocated_grpo.launch import processes
from colocated_grpo.resilience import attempts, checkpoints
from colocated_grpo.resilience.signals import TrainingInterrupted
from colocated_grpo.telemetry.nvml import SERVER_GPUS_ENV
from colocated_grpo.training import config, models
from colocated_grpo.training.config import ConfigError

log = logging.getLogger(__name__)

ROLE_ENV = "COLOCATED_GRPO_ROLE"  # "trainer" in the torchrun child: train instead of launching


class ServerError(RuntimeError):
    pass


@dataclass(frozen=True)
class ServerPlan:
    train_gpus: list[str]  # CUDA_VISIBLE_DEVICES entries for the trainer
    server_gpus: list[str]  # and for the server
    port: int
    group_port: int  # NCCL rendezvous port of the weight sync

    @property
    def nproc(self) -> int:
        return len(self.train_gpus)


def is_launcher(cfg: DictConfig) -> bool:
    return cfg.placement.name == "server" and os.environ.get(ROLE_ENV) != "trainer"


def visible_gpus() -> list[str]:
    """UUIDs of the GPUs this process may use, in CUDA_VISIBLE_DEVICES order (all GPUs when it is unset)."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        why = "TRL syncs weights to a vLLM server over NCCL. On CPU use placement=colocate or placement=none"
        raise ConfigError([f"placement=server needs NVIDIA GPUs (NVML: {exc}): {why}"]) from exc
    uuid = lambda h: (lambda u: u.decode() if isinstance(u, bytes) else u)(pynvml.nvmlDeviceGetUUID(h))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return [uuid(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(pynvml.nvmlDeviceGetCount())]
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    # Integer entries are NVML (PCI bus) indices: the children run with CUDA_DEVICE_ORDER=PCI_BUS_ID.
    return [e if e.startswith(("GPU-", "MIG-")) else uuid(pynvml.nvmlDeviceGetHandleByIndex(int(e))) for e in entries]


def plan(cfg: DictConfig, gpus: list[str]) -> ServerPlan:
    """Split the GPUs and pick ports; ConfigError (before anything starts) when the placement cannot work."""
    p = cfg.placement
    k, tp, n = int(p.server_gpus), int(p.server_tensor_parallel_size), len(gpus)
    problems = []
    if k < 1 or k >= n:
        problems.append(
            f"placement.server_gpus={k} must be at least 1 and leave at least one of the {n} visible GPUs for "
            f"training; use 1..{max(1, n - 1)}" + (" (server placement needs 2+ GPUs)" if n < 2 else "")
        )
    if tp < 1 or k % tp:
        problems.append(
            f"placement.server_tensor_parallel_size={tp} must divide placement.server_gpus={k} "
            "(the server runs server_gpus / tp data-parallel engines)"
        )
    ports = {}
    for key in ("port", "group_port"):
        want = p.get(key)
        if want is not None and processes.port_in_use(int(want)):
            problems.append(f"placement.{key}={want} is in use; pick another or leave it null for a free port")
        ports[key] = int(want) if want is not None else processes.free_port()
    if problems:
        raise ConfigError(problems)
    return ServerPlan(gpus[: n - k], gpus[n - k :], ports["port"], ports["group_port"])


def server_command(cfg: DictConfig, model_path: str, plan_: ServerPlan) -> list[str]:
    """`trl vllm-serve` on the plan's port: server_gpus / tp data-parallel engines of tp GPUs each."""
    tp = int(cfg.placement.server_tensor_parallel_size)
    args = {
        "--model": model_path,
        "--tensor_parallel_size": tp,
        "--data_parallel_size": len(plan_.server_gpus) // tp,
        "--host": "127.0.0.1",
        "--port": plan_.port,
        "--gpu_memory_utilization": cfg.placement.gpu_memory_utilization,
        "--dtype": cfg.model.get("dtype", "auto"),
    }
    cmd = [sys.executable, "-m", "trl.cli.main", "vllm-serve", *(str(x) for pair in args.items() for x in pair)]
    if max_len := cfg.trainer.get("vllm_max_model_length"):
        cmd += ["--max_model_len", str(max_len)]
    return cmd


def wait_until_healthy(url: str, proc, timeout_s: float, log_path: Path) -> float:
    """Poll `url` until it answers 200; ServerError naming the cause when the server dies or time runs out."""
    # Not TRL's VLLMClient.check_server: it polls on after the server process has died, until its timeout, and
    # cannot name the cause; this stops at once with the server's exit code and last log lines.
    start = time.monotonic()
    last_lines = lambda: f"; last lines of {log_path}:\n" + "\n".join(processes.tail(log_path))
    while True:
        if proc.poll() is not None:
            raise ServerError(f"the vLLM server exited with code {proc.returncode} before it was healthy{last_lines()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return time.monotonic() - start
        except OSError:  # urllib's URLError too: not up yet
            pass
        if time.monotonic() - start > timeout_s:
            raise ServerError(
                f"the vLLM server at {url} was not healthy after {timeout_s:.0f}s (placement.health_timeout_s)"
                + last_lines()
            )
        time.sleep(1.0)


def trainer_overrides(plan_: ServerPlan, user_overrides: list[str], run_dir: Path) -> list[str]:
    return [
        *user_overrides,
        f"hydra.run.dir={run_dir}",
        f"parallelism.nproc_per_node={plan_.nproc}",
        "trainer.vllm_server_host=127.0.0.1",
        f"trainer.vllm_server_port={plan_.port}",
        f"trainer.vllm_group_port={plan_.group_port}",
    ]


def run_placement(cfg: DictConfig, run_dir: Path) -> None:
    """This process only orchestrates: vLLM server on the last GPUs, a torchrun trainer on the others."""
    run_dir.mkdir(parents=True, exist_ok=True)
    plan_ = plan(cfg, visible_gpus())
    config.validate(cfg, plan_.nproc)
    user_overrides = [o for o in task_overrides() or [] if not o.startswith("hydra.run.dir=")]
    code = launch(cfg, plan_, run_dir, user_overrides, models.resolve(cfg.model))
    if code != 0:
        raise SystemExit(
            f"server placement: the trainer failed with exit code {code} (see {run_dir / run_files.TRAINER_LOG})"
        )


def _run_trainer(command: list[str], log_path: Path, env: dict, grace_s: float, resume: str) -> int:
    """The trainer's exit code. SIGTERM (preemption) or Ctrl-C here is passed to the trainer, which gets `grace_s`
    to finish its step and save; then TrainingInterrupted says what was cut, exiting as the trainer did."""
    trainer = processes.start(command, log_path, env, grace_s=grace_s)
    try:
        return trainer.wait()
    except KeyboardInterrupt as stop:  # signals.run_main turns SIGTERM into one (StoppedAtOnce); Ctrl-C is one
        signum = getattr(stop, "code", 128 + signal.SIGINT) - 128
        name = signal.Signals(signum).name
        log.warning("%s: passed to the trainer, which has %.0f s (placement.stop_grace_s) to save", name, grace_s)
        code = processes.stop(trainer, grace_s, signum)
        if cut := what_the_trainer_saved(log_path):
            what = f"the trainer stopped (exit {code}) by {cut}"
        else:
            last = checkpoints.latest(log_path.parent)  # the trainer's log lies in the run directory
            what = f"the trainer stopped without saying it saved (exit {code}); latest checkpoint: {last and last.path}"
        message = f"server placement: {name} received; {what}; the server stops too. Resume with: {resume}"
        print(message, file=sys.stderr, flush=True)
        raise TrainingInterrupted(code - 128 if code > 128 else signum, message) from None
    finally:
        processes.stop(trainer, 1.0)  # stragglers of a trainer that ended (none is the usual case)


# Lines of the trainer's log searched, from its end, for its own stop line: after it come the other ranks' and
# torchrun's (torch's own torchrun adds a SignalException traceback of about 30), so the 30 lines shown of a failure
# are too few.
STOP_LINE_WINDOW = 1000


def what_the_trainer_saved(log_path: Path) -> str | None:
    """What the trainer's last stop line (resilience/attempts.py: "training stopped by …") says it saved, or None."""
    said = [line for line in processes.tail(log_path, STOP_LINE_WINDOW) if "training stopped by" in line]
    return said[-1].split("training stopped by", 1)[1].split("; run files", 1)[0].strip() if said else None


def launch(cfg: DictConfig, plan_: ServerPlan, run_dir: Path, user_overrides: list[str], model_path: str) -> int:
    """Run server + trainer; returns the trainer's exit code. Both process groups are gone when this returns."""
    (run_dir / run_files.PLACEMENT).write_text(json.dumps(plan_.__dict__, indent=2))
    base_env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    server_log = run_dir / run_files.SERVER_LOG
    server_env = {**base_env, "CUDA_VISIBLE_DEVICES": ",".join(plan_.server_gpus)}
    server = processes.start(server_command(cfg, model_path, plan_), server_log, server_env)
    try:
        url = f"http://127.0.0.1:{plan_.port}/health"
        startup = wait_until_healthy(url, server, float(cfg.placement.health_timeout_s), server_log)
        log.info(
            "vLLM server healthy on GPUs %s after %.0fs; training on %s", plan_.server_gpus, startup, plan_.train_gpus
        )
        trainer_env = {
            **base_env,
            "CUDA_VISIBLE_DEVICES": ",".join(plan_.train_gpus),
            ROLE_ENV: "trainer",
            SERVER_GPUS_ENV: ",".join(plan_.server_gpus),
        }
        trainer_log = run_dir / run_files.TRAINER_LOG
        command = processes.train_command(plan_.nproc, trainer_overrides(plan_, user_overrides, run_dir))
        resume = checkpoints.launch_command(run_dir, user_overrides, world=1)  # this process's, with one server
        trainer_env[attempts.RESUME_COMMAND_ENV] = resume  # what the trainer's interruption line names
        code = _run_trainer(command, trainer_log, trainer_env, float(cfg.placement.stop_grace_s), resume)
        if code != 0:
            last_lines = "\n".join(processes.tail(trainer_log))
            log.error("trainer exited with code %s; last lines of %s:\n%s", code, trainer_log, last_lines)
        return code
    finally:
        processes.stop(server)
