"""The local sweep launcher: every job is a fresh `torchrun --nproc_per_node=N train.py hydra.run.dir=JOB_DIR …`
(or, for server placement, one `python train.py` that starts its server and torchrun), one after another, output in
JOB_DIR/job.log. A failed job is recorded and the sweep goes on; Ctrl-C stops the running job and the sweep. While it
runs: job k/N, step, time elapsed and left; at the end SWEEP_DIR/summary.csv and a table, one row per job."""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from colocated_grpo import run_files
from colocated_grpo.analysis import tables
from colocated_grpo.launch import collector, processes, sweep_plan
from colocated_grpo.launch.progress import Progress, run_step
from colocated_grpo.launch.sweep_plan import Job, Options, plan, quote
from colocated_grpo.resilience.signals import sigterm_as_interrupt
from colocated_grpo.run_files import now
from colocated_grpo.telemetry import nvml

log = logging.getLogger(__name__)


def torchrun_command(job: Job, script: str, master_port: int, **node) -> list[str]:
    """The command that runs one job (on one node of it: `node` holds node_rank, master_addr, extra_args)."""
    args = [f"hydra.run.dir={quote(job.dir)}", *job.overrides]
    return processes.torchrun_command(job.nproc_per_node, args, script, master_port, nnodes=job.nnodes, **node)


def job_environment() -> dict[str, str]:
    """The environment of a job: ours, less what torchrun sets per worker, with unbuffered output and full errors."""
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_SETS}
    return {**env, "PYTHONUNBUFFERED": "1", "HYDRA_FULL_ERROR": "1"}


_TORCHRUN_SETS = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
}


def execute(job: Job, command: list[str], log_path: Path, opts: Options, records: bool = True) -> dict:
    """Run one job's command to the end, its output in log_path; record the outcome in job.json (when `records`).
    On KeyboardInterrupt (Ctrl-C, or SIGTERM) the job's processes are stopped and the job recorded as interrupted."""
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
        outcome = dict(command=command, started=started, ended=now(), duration_s=round(time.monotonic() - t0, 1))
        outcome.update(exit_code=exit_code, log=log_path.name, log_tail=processes.tail(log_path, opts.log_tail_lines))
        outcome["error"] = error_line(log_path) if job.status != "finished" else None
        record = job.save(**outcome) if records else job.record(**outcome)
    if job.status == "failed":
        log.warning("#%d failed (exit code %s): %s; see %s", job.num, exit_code, record["error"], log_path)
    else:
        log.info("#%d %s in %.0f s", job.num, job.status, record["duration_s"])
    return record


_RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:\s?")


# torchrun's summary of a worker that a signal ended: "  traceback : Signal 9 (SIGKILL) received by PID 1794"
_SIGNALLED = re.compile(r"^traceback\s*: Signal (\d+) \((SIG\w+)\) received by PID (\d+)")
_STOPPED = "training stopped by "  # the runner's line when a signal stopped it (resilience/attempts.py)


def error_line(log_path: Path) -> str | None:
    """The last exception a failed job's log reports (the cause, not torchrun's ChildFailedError about it); for a
    job stopped by a signal, the runner's line saying where it stopped; for a worker that a signal ended without an
    error of its own (the kernel's out-of-memory killer sends SIGKILL), a line of ours that says so."""
    found = stopped = signalled = None
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = _RANK_PREFIX.sub("", line).strip()  # torchrun's "[rank0]: " before a worker's lines
                head = line.split(":", 1)[0]
                exception = ":" in line and " " not in head and head.endswith(("Error", "Exception", "Interrupt"))
                if exception and not head.endswith("ChildFailedError"):
                    found = line
                if _STOPPED in line:
                    stopped = _STOPPED + line.split(_STOPPED, 1)[1].split("; run files", 1)[0]
                signalled = _SIGNALLED.match(line) or signalled
    except OSError:
        pass
    found = found or stopped
    if found is None and signalled is not None:
        number, name, pid = signalled.groups()
        found = f"Killed: training process {pid} was ended by {name} (signal {number}) without an error of its own"
        if name == "SIGKILL":
            found += (
                "; when nobody sent it, it is the kernel's out-of-memory killer: the host ran out of CPU memory "
                "(`dmesg` names it; parallelism=zero3_offload keeps the optimizer state and fp32 weights there)"
            )
    return found


def launch_local(hydra_context, config: DictConfig, task_function, job_overrides, initial_job_idx: int, opts: Options):
    """Run the jobs one after another, each as its own torchrun on this machine; returns Hydra JobReturns."""
    script = opts.script or sweep_plan.default_script(task_function)
    with collector.paused_for_imports():  # the checks may import torch, peft, TRL: GPUs, LoRA, no field table
        jobs = plan(hydra_context, config, job_overrides, initial_job_idx, gpus_here=nvml.cuda_devices())
    sweep_dir = announce(config, jobs, opts.dry_run)
    interrupted = False
    runnable = [] if opts.dry_run else [job for job in jobs if job.status == "pending"]
    try:
        with sigterm_as_interrupt(), Progress("sweep", len(runnable), say=log.info) as shown:
            for job in runnable:
                # a server-placement job is one plain process: it starts the server and its own torchrun
                command = (
                    [sys.executable, script, f"hydra.run.dir={quote(job.dir)}", *job.overrides]
                    if job.server
                    else torchrun_command(job, script, processes.free_port(), extra_args=opts.torchrun_args)
                )
                with shown.job(f"#{job.num} {' '.join(job.swept) or 'job'}", lambda d=Path(job.dir): run_step(d)):
                    execute(job, command, Path(job.dir) / run_files.JOB_LOG, opts)
    except KeyboardInterrupt:
        interrupted = True
        cancel_pending(jobs)
    finally:  # what stays frozen is never freed at exit, and triton's bindings then report leaks
        gc.unfreeze()
    return finish(sweep_dir, jobs, interrupted)


def announce(config: DictConfig, jobs: list[Job], dry_run: bool) -> Path:
    sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
    runnable = [j for j in jobs if j.status == "pending"]
    if dry_run:
        for job in runnable:
            job.status = "planned"
    group, skipped = sweep_plan.wandb_group(config), len(jobs) - len(runnable)
    log.info(f"sweep {sweep_dir}: {len(jobs)} jobs, {len(runnable)} runnable, {skipped} skipped (W&B group {group})")
    for job in jobs:
        job.save()
        what = f"skipped: {job.reason}" if job.reason else f"nproc_per_node={job.nproc_per_node} nnodes={job.nnodes}"
        log.info("  #%d %s  (%s)", job.num, " ".join(job.swept) or "-", what)
    return sweep_dir


def cancel_pending(jobs: list[Job]) -> None:
    for job in jobs:
        if job.status == "pending":
            job.status = "cancelled"
            job.save()


def finish(sweep_dir: Path, jobs: list[Job], interrupted: bool):
    """Write and print the summary; end the sweep with exit code 130 when it was interrupted."""
    from hydra.core.utils import JobReturn, JobStatus

    rows = tables.load_jobs(sweep_dir)  # every job's run files, read once for the file and the table
    csv = tables.write_summary(sweep_dir, rows)
    tables.print_summary(sweep_dir, rows=rows)
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
