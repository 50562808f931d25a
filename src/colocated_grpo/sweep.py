"""Sweeps in which every job is a fresh `torchrun` (locally, or one SLURM job per sweep job through submitit).

One process group and one vLLM engine per process lifetime: a job never runs inside the sweep's own process. The
Hydra launchers in hydra_plugins/torchrun_launcher call into this module:

1. plan: compose every job's config, name its directory, and check it with `config.validate` on the world size it
   would get; a job that cannot run on the GPUs at hand is skipped with the reason, before anything is launched.
2. run: `python -m torch.distributed.run --nproc_per_node=N … train.py hydra.run.dir=JOB_DIR OVERRIDES…`, with
   N = the job's `parallelism.nproc_per_node`, stdout and stderr in JOB_DIR/job.log. A failed job is recorded (exit
   code, last log lines) and the sweep goes on; Ctrl-C stops the running job and its processes, and the sweep.
3. summarise: SWEEP_DIR/summary.csv and a table, one row per job (colocated_grpo.analysis).

Every job directory holds job.json with the job's overrides, status (pending, running, finished, failed, skipped,
interrupted, cancelled), exit code and log tail; the W&B runs of a sweep share one group (logger.group).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import sys
import time
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import List, Optional  # noqa: UP035 - OmegaConf reads these annotations (structured configs)

from omegaconf import DictConfig, OmegaConf, open_dict

from colocated_grpo import analysis, processes
from colocated_grpo.processes import free_port
from colocated_grpo.run_files import now, read_json, write_json

log = logging.getLogger(__name__)

LOG_FILE = "job.log"


@dataclasses.dataclass
class Options:
    """The launchers' own settings (hydra.launcher.*; also the schema of their Hydra configs, hence the typing)."""

    script: Optional[str] = None  # the training script; None: the file of the sweep's task function (train.py)
    torchrun_args: List[str] = dataclasses.field(default_factory=list)  # extra flags, e.g. ["--max-restarts=1"]
    stop_grace_s: float = 30.0  # after Ctrl-C, how long a job may take to exit before it is killed
    log_tail_lines: int = 30  # lines of a job's log kept in job.json
    dry_run: bool = False  # plan and record the jobs (and the skipped ones, with reasons), launch nothing

    @classmethod
    def split(cls, params: dict) -> tuple[Options, dict]:
        """hydra.launcher's fields → (these options, the rest: the executor's parameters)."""
        names = {f.name for f in dataclasses.fields(cls)}
        ours = {k: v for k, v in params.items() if k in names}
        return cls(**ours), {k: v for k, v in params.items() if k not in names}


@dataclasses.dataclass
class Job:
    num: int
    overrides: list[str]  # all of the job's overrides, passed on to train.py
    swept: list[str]  # the overrides in which the jobs of the sweep differ: what names the job
    dir: str
    nproc_per_node: int
    nnodes: int = 1
    server: bool = False  # vllm=server: the job is one `python train.py` that starts its server and torchrun
    status: str = "pending"
    reason: str | None = None  # why a job was skipped
    placement: dict | None = None  # analysis.PLACEMENT_KEYS as planned: what a job that never ran would have used

    def record(self, **extra) -> dict:
        return {**dataclasses.asdict(self), **extra}

    def save(self, **extra) -> dict:
        record = self.record(**extra)
        Path(self.dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(self.dir) / analysis.JOB_FILE, record)
        return record


# ----------------------------------------------------------------------------------------------------- planning


def plan(hydra_context, config: DictConfig, job_overrides, initial_job_idx: int, nnodes: int = 1,
         gpus_here: int | None = None) -> list[Job]:  # fmt: skip
    """Compose each job's config, name its directory, and skip what cannot run (with the reason)."""
    from hydra.core.hydra_config import HydraConfig

    sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
    swept_keys = sweep_keys(config)
    group = wandb_group(config)
    hydra_cfg = HydraConfig.instance()
    saved = hydra_cfg.cfg
    jobs = []
    try:
        for num, overrides in enumerate(job_overrides, start=initial_job_idx):
            overrides = list(overrides)
            job_cfg = hydra_context.config_loader.load_sweep_config(config, overrides)
            swept = [o for o in overrides if _key(o) in swept_keys]
            with open_dict(job_cfg):
                job_cfg.hydra.job.id = str(num)
                job_cfg.hydra.job.num = num
                # The job directory (hydra.sweep.subdir) and with it the W&B run name say what differs between jobs.
                job_cfg.hydra.job.override_dirname = _override_dirname(job_cfg, swept)
            hydra_cfg.set_config(job_cfg)
            subdir = str(OmegaConf.select(job_cfg, "hydra.sweep.subdir"))
            if OmegaConf.select(job_cfg, "logger.group") is None:
                overrides.append(f"++logger.group={quote(group)}")
            nproc = int(OmegaConf.select(job_cfg, "parallelism.nproc_per_node", default=1))
            server = OmegaConf.select(job_cfg, "placement.name") == "server"
            placement = analysis.placement_settings(lambda key, c=job_cfg: OmegaConf.select(c, key), nproc * nnodes)
            job = Job(num, overrides, swept, str(sweep_dir / subdir), nproc, nnodes, server=server, placement=placement)
            job.reason = server_skip_reason(job_cfg, gpus_here) if server else skip_reason(job_cfg, nproc * nnodes, gpus_here)
            if job.reason:
                job.status = "skipped"
            jobs.append(job)
    finally:
        hydra_cfg.cfg = saved
    return jobs


def skip_reason(job_cfg: DictConfig, world: int, gpus_here: int | None = None) -> str | None:
    """Why this job cannot run on `world` processes (None when it can): config.validate's problems and, when
    `gpus_here` says what this machine has (None: the jobs run elsewhere), what its GPUs cannot do."""
    from colocated_grpo.config import ConfigError, validate

    problems = []
    nproc = int(OmegaConf.select(job_cfg, "parallelism.nproc_per_node", default=1))
    trainer = job_cfg.trainer
    if gpus_here == 0 and trainer.get("use_vllm") and trainer.get("vllm_enable_sleep_mode"):
        problems.append(
            "trainer.vllm_enable_sleep_mode=true (vllm=colocate_sleep) needs a GPU; vLLM on CPU has no sleep mode"
        )
    if gpus_here and nproc > gpus_here:
        problems.append(f"parallelism.nproc_per_node={nproc} needs {nproc} GPUs; this machine has {gpus_here}")
    try:
        validate(job_cfg, world)
    except ConfigError as err:
        problems += err.problems
    return "; ".join(problems) or None


def sweep_keys(config: DictConfig) -> set[str]:
    """Keys that take several values in this sweep (hydra.sweeper.params, then the command line, which wins)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = [f"{k}={v}" for k, v in (OmegaConf.select(config, "hydra.sweeper.params") or {}).items()]
    lines += list(OmegaConf.select(config, "hydra.overrides.task") or [])
    swept = {}
    for override in OverridesParser.create().parse_overrides(lines):
        swept[override.key_or_group] = override.is_sweep_override()
    return {key for key, is_sweep in swept.items() if is_sweep}


def wandb_group(config: DictConfig) -> str:
    """The W&B group of a sweep's runs: the name of its directory (time and sweep name)."""
    return Path(str(config.hydra.sweep.dir)).name


def _override_dirname(job_cfg: DictConfig, swept: list[str]) -> str:
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser

    spec = job_cfg.hydra.job.config.override_dirname
    return get_overrides_dirname(
        overrides=OverridesParser.create().parse_overrides(swept),
        exclude_keys=list(spec.exclude_keys), item_sep=spec.item_sep, kv_sep=spec.kv_sep,
    )  # fmt: skip


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("~+")


def quote(value: str) -> str:
    """A Hydra override value that stays one string whatever it holds (`,` would make a sweep, `=` a key)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def gpus_on_this_machine() -> int:
    """CUDA devices on this machine (0 on a CPU-only one)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_script(task_function) -> str:
    import inspect

    return str(Path(inspect.getfile(task_function)).resolve())


# ---------------------------------------------------------------------------------------------------- one job


def server_skip_reason(job_cfg: DictConfig, gpus_here: int | None) -> str | None:
    """A server-placement job takes every GPU of the machine: K serve, the rest train."""
    from colocated_grpo.config import ConfigError, validate

    k = int(job_cfg.placement.server_gpus)
    if gpus_here is not None and gpus_here <= k:
        return (f"vllm=server with placement.server_gpus={k} needs more than {k} GPUs; this machine has {gpus_here}"
                + (" (TRL syncs weights to a vLLM server over NCCL)" if gpus_here == 0 else ""))  # fmt: skip
    try:
        validate(job_cfg, (gpus_here or k + 1) - k)
    except ConfigError as err:
        return "; ".join(err.problems)
    return None


def server_command(job: Job, script: str) -> list[str]:
    """A server-placement job is one plain process: it starts the server and its own torchrun (server.py)."""
    return [sys.executable, script, f"hydra.run.dir={quote(job.dir)}", *job.overrides]


def torchrun_command(job: Job, script: str, master_port: int, node_rank: int = 0, master_addr: str = "127.0.0.1",
                     extra_args: Sequence[str] = ()) -> list[str]:  # fmt: skip
    """The command that runs one job (on one node of it)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={job.nnodes}", f"--node_rank={node_rank}", f"--nproc_per_node={job.nproc_per_node}",
        f"--master_addr={master_addr}", f"--master_port={master_port}", *extra_args,
        script, f"hydra.run.dir={quote(job.dir)}", *job.overrides,
    ]  # fmt: skip


def job_environment() -> dict[str, str]:
    """The environment of a job: ours, less what torchrun sets per worker, with unbuffered output and full errors."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_SETS}
    return {**env, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}


_TORCHRUN_SETS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RUN_ID"}  # fmt: skip


def execute(job: Job, command: list[str], log_path: Path, opts: Options, records: bool = True) -> dict:
    """Run one job's command to the end, its output in log_path; record the outcome in job.json (when `records`).

    On KeyboardInterrupt (Ctrl-C, or SIGTERM turned into one) the job's processes are stopped and the job is
    recorded as interrupted before the interrupt goes on.
    """
    started, t0 = now(), time.monotonic()
    job.status = "running"
    if records:
        job.save(command=command, started=started)
    log.info("#%d %s: %s", job.num, " ".join(job.swept) or "job", log_path)
    exit_code = None
    try:
        # SIGINT first: torchrun passes it on and the runner records the run as interrupted
        exit_code = processes.run(command, log_path, job_environment(), opts.stop_grace_s, signal.SIGINT)
        job.status = "finished" if exit_code == 0 else "failed"
    except KeyboardInterrupt:
        job.status = "interrupted"
        raise
    finally:
        outcome = dict(
            command=command, started=started, ended=now(), duration_s=round(time.monotonic() - t0, 1),
            exit_code=exit_code, log=log_path.name, log_tail=processes.tail(log_path, opts.log_tail_lines),
            error=error_line(log_path) if job.status != "finished" else None,
        )  # fmt: skip
        record = job.save(**outcome) if records else job.record(**outcome)
    if job.status == "failed":
        log.warning("#%d failed (exit code %s): %s; see %s", job.num, exit_code, record["error"], log_path)
    else:
        log.info("#%d %s in %.0f s", job.num, job.status, record["duration_s"])
    return record


_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")


def error_line(log_path: Path) -> str | None:
    """The last exception a failed job's log reports (the cause, not torchrun's ChildFailedError about it)."""
    found = None
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = _RANK_PREFIX.sub("", line).strip()  # torchrun's "[rank0]: " before a worker's lines
                head = line.split(":", 1)[0]
                if ":" in line and head.endswith(("Error", "Exception", "Interrupt")) and " " not in head:
                    if not head.endswith("ChildFailedError"):
                        found = line
    except OSError:
        pass
    return found


@contextlib.contextmanager
def sigterm_as_interrupt():
    """SIGTERM (kill, a scheduler) stops the sweep like Ctrl-C does: the running job is stopped, not orphaned."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------------------------------ the local launcher


def launch_local(hydra_context, config: DictConfig, task_function, job_overrides, initial_job_idx: int,
                 opts: Options):  # fmt: skip
    """Run the jobs one after another, each as its own torchrun on this machine; returns Hydra JobReturns."""
    script = opts.script or default_script(task_function)
    jobs = plan(hydra_context, config, job_overrides, initial_job_idx, gpus_here=gpus_on_this_machine())
    sweep_dir = _announce(config, jobs, opts.dry_run)
    interrupted = False
    try:
        with sigterm_as_interrupt():
            for job in [] if opts.dry_run else jobs:
                if job.status == "pending":
                    command = (server_command(job, script) if job.server
                               else torchrun_command(job, script, free_port(), extra_args=opts.torchrun_args))  # fmt: skip
                    execute(job, command, Path(job.dir) / LOG_FILE, opts)
    except KeyboardInterrupt:
        interrupted = True
        _cancel_pending(jobs)
    return _finish(sweep_dir, jobs, interrupted)


def _announce(config: DictConfig, jobs: list[Job], dry_run: bool) -> Path:
    sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
    runnable = [j for j in jobs if j.status == "pending"]
    if dry_run:
        for job in runnable:
            job.status = "planned"
    log.info("sweep %s: %d jobs, %d runnable, %d skipped (W&B group %s)", sweep_dir, len(jobs), len(runnable),
             len(jobs) - len(runnable), wandb_group(config))  # fmt: skip
    for job in jobs:
        job.save()
        what = f"skipped: {job.reason}" if job.reason else f"nproc_per_node={job.nproc_per_node} nnodes={job.nnodes}"
        log.info("  #%d %s  (%s)", job.num, " ".join(job.swept) or "-", what)
    return sweep_dir


def _cancel_pending(jobs: list[Job]) -> None:
    for job in jobs:
        if job.status == "pending":
            job.status = "cancelled"
            job.save()


def _finish(sweep_dir: Path, jobs: list[Job], interrupted: bool):
    """Write and print the summary; end the sweep with exit code 130 when it was interrupted."""
    from hydra.core.utils import JobReturn, JobStatus

    rows = analysis.load_jobs(sweep_dir)  # every job's run files, read once for the file and the table
    csv = analysis.write_summary(sweep_dir, rows)
    analysis.print_summary(sweep_dir, rows=rows)
    log.info("sweep summary: %s", csv)
    if interrupted:
        log.error("sweep interrupted; jobs not run are marked cancelled in %s", csv)
        raise SystemExit(130)
    returns = []
    for job in jobs:
        ret = JobReturn(overrides=job.overrides, working_dir=job.dir, task_name=Path(job.dir).name)
        ret.status = JobStatus.COMPLETED  # a failed job is a result of the sweep, not a reason to stop it
        ret.return_value = job.record()
        returns.append(ret)
    return returns


# --------------------------------------------------------------------------------- SLURM (and local) via submitit


def submitit_executor(kind: str, params: dict):
    """A submitit executor from hydra.launcher's submitit fields, as hydra-submitit-launcher maps them."""
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    params = dict(params)
    init = {"folder": params.pop("submitit_folder")}
    if "max_num_timeout" in params:
        init[f"{kind}_max_num_timeout"] = params.pop("max_num_timeout")
    executor = submitit.AutoExecutor(cluster=kind, **init)
    base = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(**{k if k in base else f"{kind}_{k}": v for k, v in params.items()})
    return executor


def launch_submitit(kind: str, params: dict, hydra_context, config: DictConfig, task_function, job_overrides,
                    initial_job_idx: int, opts: Options):  # fmt: skip
    """Submit every runnable job as one submitit job of `nodes` tasks (one per node, each starting torchrun with
    the rendezvous taken from SLURM's environment); wait for them, then summarise.

    `gpus_per_node` left unset means the job's parallelism.nproc_per_node. The local executor runs the jobs one
    after another on this machine; SLURM runs them as an array.
    """
    opts = dataclasses.replace(opts, script=opts.script or default_script(task_function))
    params = dict(params)
    nnodes = int(params.get("nodes") or 1)
    gpus_per_node = params.pop("gpus_per_node", None)
    params["tasks_per_node"] = 1
    jobs = plan(hydra_context, config, job_overrides, initial_job_idx, nnodes=nnodes)
    sweep_dir = _announce(config, jobs, opts.dry_run)
    executor = submitit_executor(kind, params) if any(j.status == "pending" for j in jobs) else None
    submitted = []
    interrupted = False
    try:
        with sigterm_as_interrupt():
            by_size: dict[int, list[Job]] = {}
            for job in (j for j in jobs if j.status == "pending"):
                by_size.setdefault(job.nproc_per_node, []).append(job)
            for nproc, group in by_size.items():
                executor.update_parameters(gpus_per_node=gpus_per_node or nproc)
                if kind == "local":  # one machine: one job at a time
                    for job in group:
                        submitted.append((job, executor.submit(run_on_node, job, opts)))
                        _collect(*submitted[-1])
                else:
                    submitted += zip(group, executor.map_array(run_on_node, group, [opts] * len(group)))
            for job, sub in submitted:
                if job.status == "pending":
                    _collect(job, sub)
    except KeyboardInterrupt:
        interrupted = True
        for job, sub in submitted:
            if job.status == "pending":  # submitted, not collected: cancel it; a node that ran records itself
                with contextlib.suppress(Exception):
                    sub.cancel(check=False)
                job.status = "interrupted"
                on_disk = read_json(Path(job.dir) / analysis.JOB_FILE) or {}
                if on_disk.get("status") in (None, "pending", "running"):
                    write_json(Path(job.dir) / analysis.JOB_FILE, {**on_disk, **job.record()})
        _cancel_pending(jobs)
    return _finish(sweep_dir, jobs, interrupted)


def _collect(job: Job, submission) -> None:
    """Wait for a submitted job; what its node 0 recorded in job.json is its outcome."""
    try:
        record = submission.results()[0]
        job.status = record["status"]
    except Exception as err:  # the scheduler or submitit failed the job before or around our code
        job.status = "failed"
        job.save(exit_code=None, log_tail=str(err).splitlines()[-30:], submitit_job=submission.job_id)


def node_command(job: Job, opts: Options) -> tuple[list[str], Path]:
    """The torchrun command of this node of a submitit job, and its log file.

    The rendezvous comes from the scheduler's environment (SLURM_JOB_NODELIST, SLURM_NODEID, SLURM_JOB_NUM_NODES
    through submitit.JobEnvironment): rank 0's node is the first host, the port is derived from the job id so that
    every node agrees on it without talking (a free port when the job has one node).
    """
    import submitit

    env = submitit.JobEnvironment()
    node = env.node
    port = free_port() if env.num_nodes == 1 else 20000 + zlib.crc32(str(env.job_id).encode()) % 20000
    if env.num_nodes != job.nnodes:
        raise RuntimeError(f"job #{job.num} was planned for {job.nnodes} nodes but runs on {env.num_nodes}")
    command = torchrun_command(job, opts.script, port, node_rank=node, master_addr=env.hostnames[0],
                               extra_args=opts.torchrun_args)  # fmt: skip
    return command, Path(job.dir) / (LOG_FILE if node == 0 else f"job.node{node}.log")


def run_on_node(job: Job, opts: Options) -> dict:
    """What each task of a submitit job runs: torchrun for this node; node 0 records the job."""
    import submitit

    command, log_path = node_command(job, opts)
    with sigterm_as_interrupt():
        return execute(job, command, log_path, opts, records=submitit.JobEnvironment().node == 0)
