"""Sweep planning: before anything is launched, compose every job's config, name its directory and validate it on
the world size it would get; a job that cannot run on the GPUs at hand is skipped with the reason. Every job
directory holds job.json: overrides, status (pending, running, finished, failed, skipped, interrupted, cancelled),
exit code, log tail. A sweep's W&B runs share one group."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import List, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

from colocated_grpo import run_files
from colocated_grpo.analysis import tables
from colocated_grpo.compat.hydra import override_dirname
from colocated_grpo.run_files import write_json
from colocated_grpo.training.config import ConfigError, gpu_only_problems, validate


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
    server: bool = False  # placement=server: the job is one `python train.py` that starts its server and torchrun
    status: str = "pending"
    reason: str | None = None  # why a job was skipped
    # analysis.tables.PLACEMENT_KEYS as planned: what a job that never ran would have used
    placement: dict | None = None

    def record(self, **extra) -> dict:
        return {**dataclasses.asdict(self), **extra}

    def save(self, **extra) -> dict:
        record = self.record(**extra)
        Path(self.dir).mkdir(parents=True, exist_ok=True)
        write_json(Path(self.dir) / run_files.JOB, record)
        return record


def plan(
    hydra_context,
    config: DictConfig,
    job_overrides,
    initial_job_idx: int,
    nnodes: int = 1,
    gpus_here: int | None = None,
) -> list[Job]:
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
            swept = [o for o in overrides if o.split("=", 1)[0].lstrip("~+") in swept_keys]  # key of `~+key=value`
            with open_dict(job_cfg):
                job_cfg.hydra.job.id = str(num)
                job_cfg.hydra.job.num = num
                # The job directory (hydra.sweep.subdir) and with it the W&B run name say what differs between jobs.
                job_cfg.hydra.job.override_dirname = override_dirname(swept, job_cfg.hydra.job.config.override_dirname)
            hydra_cfg.set_config(job_cfg)
            job_dir = str(sweep_dir / str(OmegaConf.select(job_cfg, "hydra.sweep.subdir")))
            if OmegaConf.select(job_cfg, "logger.group") is None:
                overrides.append(f"++logger.group={quote(group)}")
            nproc = int(OmegaConf.select(job_cfg, "parallelism.nproc_per_node", default=1))
            server = OmegaConf.select(job_cfg, "placement.name") == "server"
            placement = tables.placement_settings(lambda key, c=job_cfg: OmegaConf.select(c, key), nproc * nnodes)
            reason = (
                server_skip_reason(job_cfg, gpus_here) if server else skip_reason(job_cfg, nproc * nnodes, gpus_here)
            )
            status = "skipped" if reason else "pending"
            jobs.append(Job(num, overrides, swept, job_dir, nproc, nnodes, server, status, reason, placement))
    finally:
        hydra_cfg.cfg = saved
    return jobs


def skip_reason(job_cfg: DictConfig, world: int, gpus_here: int | None = None) -> str | None:
    """Why this job cannot run on `world` processes (None when it can): config.validate's problems and, when
    `gpus_here` says what this machine has (None: the jobs run elsewhere), what its GPUs cannot do."""
    problems = []
    nproc = int(OmegaConf.select(job_cfg, "parallelism.nproc_per_node", default=1))
    if gpus_here == 0:
        problems += gpu_only_problems(job_cfg)
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
    swept = {o.key_or_group: o.is_sweep_override() for o in OverridesParser.create().parse_overrides(lines)}
    return {key for key, is_sweep in swept.items() if is_sweep}


def wandb_group(config: DictConfig) -> str:
    """The W&B group of a sweep's runs: the name of its directory (time and sweep name)."""
    return Path(str(config.hydra.sweep.dir)).name


def quote(value: str) -> str:
    """A Hydra override value that stays one string whatever it holds (`,` would make a sweep, `=` a key)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def default_script(task_function) -> str:
    import inspect

    return str(Path(inspect.getfile(task_function)).resolve())


def server_skip_reason(job_cfg: DictConfig, gpus_here: int | None) -> str | None:
    """A server-placement job takes every GPU of the machine: K serve, the rest train."""
    k = int(job_cfg.placement.server_gpus)
    if gpus_here is not None and gpus_here <= k:
        return (
            f"placement=server with placement.server_gpus={k} needs more than {k} GPUs; this machine has "
            f"{gpus_here}" + (" (TRL syncs weights to a vLLM server over NCCL)" if gpus_here == 0 else "")
        )
    try:
        validate(job_cfg, (gpus_here or k + 1) - k)
    except ConfigError as err:
        return "; ".join(err.problems)
    return None
