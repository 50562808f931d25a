"""cfg → validated GRPOConfig, model, dataset and rewards → TRL GRPOTrainer → train, with the run files."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from colocated_grpo import (
    checkpointing,
    config,
    data,
    guards,
    models,
    preemption,
    resilience,
    rewards,
    rollouts,
    run_files,
    server,
    tracking,
    wandb_resume,
)
from colocated_grpo.telemetry.callback import MetricsFileCallback, TelemetryCallback

log = logging.getLogger(__name__)


def run(cfg: DictConfig, run_dir: str | Path | None = None) -> Path:
    """Train one GRPO job as configured; returns the run directory. Every rank calls this.

    A run directory that already holds this run is resumed from its newest checkpoint (`run.resume`, see
    checkpointing.py); SIGTERM or Ctrl-C saves a checkpoint and exits non-zero (preemption.py).
    """
    run_dir = Path(run_dir or _hydra_output_dir()).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if server.is_launcher(cfg):
        return _launch_server_placement(cfg, run_dir)
    config.validate(cfg)
    main = run_files.is_main_process()
    held = checkpointing.lock(run_dir) if main else None
    try:
        return _run(cfg, run_dir, main)
    finally:
        if held is not None:
            held.release()


def _run(cfg: DictConfig, run_dir: Path, main: bool) -> Path:
    resume = checkpointing.plan(cfg, run_dir, main)
    resume_command = resilience.resume_command(run_dir)
    _prepare_environment(cfg)

    metadata = {
        "placement": cfg.placement.name,
        "world_size": config.world_size(cfg),
        "git": run_files.git_state(Path(__file__).resolve().parent),
        "versions": run_files.package_versions(),
        "command": sys.argv,
        "overrides": resilience.hydra_overrides(),
    }
    record = resilience.RunRecord(run_dir, metadata, resume, write=main)
    if main:
        resilience.prepare_run_dir(cfg, run_dir, resume)
    wandb_run = resilience.start_tracking(cfg, run_dir, metadata, resume) if main else None
    record.start(wandb_run)

    stopper = preemption.StopOnSignal()
    status, exit_code, error, interrupted = "failed", 1, None, None
    try:
        with stopper.installed():
            trainer = _start_trainer(cfg, run_dir)
            trainer.add_callback(wandb_resume.RecordWandbStep())
            if cfg.run.get("stop_on_nonfinite", True):
                trainer.add_callback(guards.StopOnNonFinite())
            trainer.add_callback(stopper)
            if stopper.signum is None:
                checkpoint = resume.checkpoint
                trainer.train(resume_from_checkpoint=str(checkpoint.path) if checkpoint else None)
        interrupted = resilience.interruption(stopper, trainer.state, run_dir, resume_command)
        status, exit_code = ("interrupted", interrupted.code) if interrupted else ("finished", 0)
    except KeyboardInterrupt:
        status, exit_code = "interrupted", 130
        raise
    except Exception as exc:
        error = exc
        raise
    finally:
        tracking.finish(wandb_run, exit_code)
        record.end(status, error)
        _close_process_group()
    if interrupted is not None:
        if main:
            log.error("%s", interrupted)
        raise interrupted
    log.info("run finished: %s", run_dir)
    return run_dir


def run_and_exit(cfg: DictConfig) -> None:
    """`run`, then end the process at once when it finished: the run's files, W&B and process group are closed by
    then, and the interpreter's own teardown can still abort a finished run on native threads left by vLLM and the
    collectives ("terminate called without an active exception", exit -6), which a sweep would record as failed."""
    run(cfg)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _launch_server_placement(cfg: DictConfig, run_dir: Path) -> Path:
    """This process only orchestrates: vLLM server on the last GPUs, a torchrun trainer on the others."""
    plan = server.plan(cfg, server.visible_gpus())
    config.validate(cfg, plan.nproc)
    code = server.launch(cfg, plan, run_dir, _user_overrides(), models.resolve(cfg.model))
    if code != 0:
        raise SystemExit(f"server placement: the trainer failed with exit code {code} (see {run_dir}/trainer.log)")
    return run_dir


def build_trainer(cfg: DictConfig, run_dir: Path):
    from trl import GRPOTrainer

    model_path = models.resolve(cfg.model)
    train_dataset = data.build(cfg.data)
    reward_funcs, _ = rewards.build(cfg.reward, check_finite=bool(cfg.run.get("stop_on_nonfinite", True)))
    if run_files.is_main_process():
        reward_funcs[0] = rollouts.recording(reward_funcs[0], run_dir)
    report_to = ["wandb"] if cfg.logger.backend == "wandb" and run_files.is_main_process() else []
    args = config.grpo_config(cfg, output_dir=str(run_dir), report_to=report_to)
    metrics_file = MetricsFileCallback(run_dir, warmup_steps=int(cfg.telemetry.warmup_steps))
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_dataset,
        callbacks=[metrics_file],
    )
    reseed_generation(trainer, int(cfg.seed))
    if cfg.telemetry.enabled:
        t = cfg.telemetry
        telemetry = TelemetryCallback(trainer, run_dir, t.interval_s, t.sync_cuda, t.peak_tflops)
        trainer.add_callback(telemetry)
        metrics_file.extras.append(telemetry.pop_step_metrics)
    return trainer


def reseed_generation(trainer, seed: int) -> None:
    """Make the seed reach vLLM's sampling (trl#7040).

    TRL builds the colocated engine with seed = rank // tp, and vLLM's start-up reseeds torch's global RNG with
    it; its sampler then draws from that RNG, so every `seed` gave the same rollouts. Reseeding after the engine
    exists restores the dependence on `seed`. Ranks of one TP group must sample identically, so they share a seed;
    different data-parallel groups get different ones.
    """
    import numpy as np
    from transformers import set_seed

    args = trainer.args
    if not (args.use_vllm and args.vllm_mode == "colocate"):
        return
    dp_rank = trainer.accelerator.process_index // args.vllm_tensor_parallel_size
    set_seed(int(np.random.SeedSequence([seed, dp_rank]).generate_state(1)[0]))


def _prepare_environment(cfg: DictConfig) -> None:
    import torch

    if not torch.cuda.is_available() and cfg.trainer.get("use_vllm"):
        # vllm-cpu sizes its KV cache from this variable instead of gpu_memory_utilization.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.run.cpu_kvcache_gb))
        from colocated_grpo import vllm_cpu

        vllm_cpu.prepare()


def _close_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _user_overrides() -> list[str]:
    return [o for o in resilience.hydra_overrides() or [] if not o.startswith("hydra.run.dir=")]


def _start_trainer(cfg: DictConfig, run_dir: Path):
    """build_trainer, with memory failures of vLLM's start-up explained in terms of our config keys."""
    try:
        return build_trainer(cfg, run_dir)
    except Exception as exc:
        explained = guards.explain_startup_error(exc, cfg)
        if explained is None:
            raise
        raise explained from exc


def _hydra_output_dir() -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir
