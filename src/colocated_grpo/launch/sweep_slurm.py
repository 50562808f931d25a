"""The SLURM sweep launcher (and submitit's local executor): every sweep job is one submitit job of one task per
node, each task starting `torchrun` for its node with the rendezvous taken from SLURM's environment."""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from colocated_grpo import run_files
from colocated_grpo.launch.processes import free_port
from colocated_grpo.launch.sweep_local import announce, cancel_pending, execute, finish, torchrun_command
from colocated_grpo.launch.sweep_plan import Job, Options, default_script, plan
from colocated_grpo.resilience.signals import sigterm_as_interrupt
from colocated_grpo.run_files import read_json, write_json


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


def launch_submitit(
    kind: str,
    params: dict,
    hydra_context,
    config: DictConfig,
    task_function,
    job_overrides,
    initial_job_idx: int,
    opts: Options,
):
    """Submit every runnable job as one submitit job of `nodes` tasks (one torchrun per node); wait, then summarise.
    `gpus_per_node` unset means the job's parallelism.nproc_per_node. SLURM runs the jobs as an array, the local
    executor one after another."""
    opts = dataclasses.replace(opts, script=opts.script or default_script(task_function))
    params = dict(params)
    nnodes = int(params.get("nodes") or 1)
    gpus_per_node = params.pop("gpus_per_node", None)
    params["tasks_per_node"] = 1
    jobs = plan(hydra_context, config, job_overrides, initial_job_idx, nnodes=nnodes)
    sweep_dir = announce(config, jobs, opts.dry_run)
    executor = submitit_executor(kind, params) if any(j.status == "pending" for j in jobs) else None
    submitted, interrupted = [], False
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
                    submitted += zip(group, executor.map_array(run_on_node, group, [opts] * len(group)), strict=True)
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
                on_disk = read_json(Path(job.dir) / run_files.JOB) or {}
                if on_disk.get("status") in (None, "pending", "running"):
                    write_json(Path(job.dir) / run_files.JOB, {**on_disk, **job.record()})
        cancel_pending(jobs)
    return finish(sweep_dir, jobs, interrupted)


def _collect(job: Job, submission) -> None:
    """Wait for a submitted job; what its node 0 recorded in job.json is its outcome."""
    try:
        record = submission.results()[0]
        job.status = record["status"]
    except Exception as err:  # the scheduler or submitit failed the job before or around our code
        job.status = "failed"
        job.save(exit_code=None, log_tail=str(err).splitlines()[-30:], submitit_job=submission.job_id)


def node_command(job: Job, opts: Options) -> tuple[list[str], Path]:
    """The torchrun command of this node of a submitit job, and its log file. The rendezvous comes from SLURM's
    environment: rank 0's node is the first host, the port derives from the job id (a free port on one node)."""
    import submitit

    env = submitit.JobEnvironment()
    node = env.node
    port = free_port() if env.num_nodes == 1 else 20000 + zlib.crc32(str(env.job_id).encode()) % 20000
    if env.num_nodes != job.nnodes:
        raise RuntimeError(f"job #{job.num} was planned for {job.nnodes} nodes but runs on {env.num_nodes}")
    command = torchrun_command(
        job, opts.script, port, node_rank=node, master_addr=env.hostnames[0], extra_args=opts.torchrun_args
    )
    return command, Path(job.dir) / (run_files.JOB_LOG if node == 0 else f"job.node{node}.log")


def run_on_node(job: Job, opts: Options) -> dict:
    """What each task of a submitit job runs: torchrun for this node; node 0 records the job."""
    import submitit

    command, log_path = node_command(job, opts)
    with sigterm_as_interrupt():
        return execute(job, command, log_path, opts, records=submitit.JobEnvironment().node == 0)
