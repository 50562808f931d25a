"""cfg → validated GRPOConfig, model, dataset and rewards → TRL GRPOTrainer → train, with the run files."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from colocated_grpo import config, data, models, rewards, rollouts, run_files, server, tracking
from colocated_grpo.telemetry.callback import MetricsFileCallback, TelemetryCallback

log = logging.getLogger(__name__)


def run(cfg: DictConfig, run_dir: str | Path | None = None) -> Path:
    """Train one GRPO job as configured; returns the run directory. Every rank calls this."""
    run_dir = Path(run_dir or _hydra_output_dir()).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    if server.is_launcher(cfg):
        return _launch_server_placement(cfg, run_dir)
    config.validate(cfg)
    main = run_files.is_main_process()
    _prepare_environment(cfg)

    metadata = {
        "placement": cfg.placement.name,
        "world_size": config.world_size(cfg),
        "git": run_files.git_state(Path(__file__).resolve().parent),
        "versions": run_files.package_versions(),
        "command": sys.argv,
    }
    if main:
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        run_files.write_json(run_dir / "run.json", {**metadata, "status": "running", "started": run_files.now()})

    wandb_run = tracking.start(cfg, run_dir, metadata) if main else None
    status, exit_code = "failed", 1
    try:
        trainer = build_trainer(cfg, run_dir)
        trainer.train()
        status, exit_code = "finished", 0
    except KeyboardInterrupt:
        status, exit_code = "interrupted", 130
        raise
    finally:
        tracking.finish(wandb_run, exit_code)
        _close_process_group()
        if main:
            run_files.write_json(
                run_dir / "run.json", {**metadata, "status": status, "started": _started(run_dir), "ended": run_files.now()}
            )
    log.info("run finished: %s", run_dir)
    return run_dir


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
    reward_funcs, _ = rewards.build(cfg.reward)
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
    from hydra.core.hydra_config import HydraConfig

    return [o for o in HydraConfig.get().overrides.task if not o.startswith("hydra.run.dir=")]


def _hydra_output_dir() -> str:
    from hydra.core.hydra_config import HydraConfig

    return HydraConfig.get().runtime.output_dir


def _started(run_dir: Path) -> str | None:
    return (run_files.read_json(run_dir / "run.json") or {}).get("started")
