"""One run's lifecycle, top-down, in every process `train.py` starts: `main` picks the role (a server placement's
orchestrator, or a trainer) and maps how it ended to the exit code; `run` trains: the checks (a refusal recorded in
run.json), the run directory and run.json, W&B, the trainer built (training/build.py), training under the signal
handler, and the end (W&B's finish, run.json, the process group), each part of the end run whatever another raised.
What SIGTERM, a second SIGTERM and Ctrl-C do in each phase and role: docs/resilience.md (its signal table)."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

# Before torch, transformers and vLLM load: W&B's init imports wandb.apis.public, whose pydantic models read their
# docstrings through `inspect.getmodule`, which scans every loaded module for each frame of the stack: 3.1 s of
# start-up once those libraries are in, 0.2 s here. A run without W&B pays the 0.2 s (TRL imports wandb itself).
import wandb.apis.public  # noqa: F401  # isort: skip
from omegaconf import DictConfig

from colocated_grpo import provenance, run_files
from colocated_grpo.compat import hydra as hydra_internals
from colocated_grpo.compat import trl as trl_internals
from colocated_grpo.compat.torch_checkpoints import restore_indexed_cpu_locations
from colocated_grpo.launch import collector, server_placement
from colocated_grpo.resilience import (
    attempts,
    checkpoints,
    disk_full,
    out_of_memory,
    process_end,
    redaction,
    run_dir_guard,
    signals,
)
from colocated_grpo.telemetry import nvml
from colocated_grpo.telemetry.phases import PHASES
from colocated_grpo.training import config, memory_plan, preflight, prompt_lengths, rewards, wandb_logging

log = logging.getLogger(__name__)


class NothingTrained(RuntimeError):
    """Training returned without a single step; the message says the likely cause and what to change."""


# Our errors whose message says what to change: printed in one line, without a traceback. Any other error, one of ours
# included (a bug), keeps its traceback. By name: some live in modules that load torch, which a refusal never loads.
EXPLAINED = (
    "colocated_grpo.training.config.ConfigError",
    "colocated_grpo.training.data.DataError",
    "colocated_grpo.training.rewards.RewardError",
    "colocated_grpo.training.wandb_logging.WandbError",
    "colocated_grpo.resilience.checkpoints.ResumeError",
    "colocated_grpo.resilience.disk_full.DiskFull",
    "colocated_grpo.resilience.out_of_memory.StartupMemoryError",
    "colocated_grpo.resilience.out_of_memory.TrainingMemoryError",
    "colocated_grpo.resilience.preemption.NonFiniteError",
    "colocated_grpo.launch.server_placement.ServerError",
    "colocated_grpo.generation.engine_process.EngineProcessDied",
    "colocated_grpo.generation.engine_process.UpstreamChanged",
    f"{__name__}.NothingTrained",
)


def is_explained(exc: BaseException) -> bool:
    """Whether `exc` is (a subclass of) one of EXPLAINED."""
    return any(f"{cls.__module__}.{cls.__qualname__}" in EXPLAINED for cls in type(exc).__mro__)


def main(cfg: DictConfig) -> None:
    """What train.py runs in each process: the orchestrator of a server placement, or a trainer. It ends the process
    with the outcome's code: 0 finished, 128 + the signal when stopped (a checkpoint saved or, where there was
    nothing to save, stopped at once), 1 failed, printed once per launch (a traceback only for what no message of
    ours explains)."""
    os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")  # W&B's Weave advertisement
    trl_internals.quiet_deprecated_checkpointing_names()  # transformers' FutureWarnings about names TRL still uses
    signals.stop_with_torchrun_agent()
    run_dir = Path(hydra_internals.output_dir()).resolve()
    try:
        if launcher := hydra_internals.in_process_multirun_launcher():
            raise config.ConfigError(
                [
                    f"hydra/launcher={launcher} runs every job of this multirun inside one process, but a job holds "
                    "one process group and one vLLM engine for the life of its process, and a finished job ends its "
                    "process (so later jobs would never run); drop hydra/launcher=… to use the default, "
                    "hydra/launcher=torchrun (a fresh torchrun per job), or use hydra/launcher=torchrun_slurm on a "
                    "cluster"
                ]
            )
        if server_placement.is_launcher(cfg):
            server_placement.run_placement(cfg, run_dir)
        else:
            run(cfg)
            # Ends at once: the interpreter's teardown can abort on vLLM's native threads (exit -6, "terminate called")
            process_end.exit_now(0)
    except signals.TrainingInterrupted as stopped:  # already said, with the command that resumes it
        process_end.exit_now(stopped.code)
    except KeyboardInterrupt as stop:  # SIGTERM in start-up, a signal repeated in training, a second Ctrl-C
        if run_files.is_main_process():
            print(str(stop) or "KeyboardInterrupt: stopped at once, without a checkpoint", flush=True)
        process_end.exit_now(getattr(stop, "code", 130))
    except Exception as exc:
        signals.ending()  # torchrun's SIGTERM (another rank failed too) must not cut this report short
        # a reward's own traceback stays: a RewardError's cause
        process_end.report_failure(exc, explained=is_explained(exc), show_cause=isinstance(exc, rewards.RewardError))
        process_end.exit_now(1)


def run(cfg: DictConfig, run_dir: str | Path | None = None) -> Path:
    """Train one GRPO job as configured; returns the run directory. Every rank calls this. A directory holding this
    run resumes from its newest checkpoint (`run.resume`); SIGTERM or Ctrl-C saves a checkpoint and exits non-zero."""
    run_dir = Path(run_dir or hydra_internals.output_dir()).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    rank0 = run_files.is_main_process()
    if rank0:  # Hydra wrote its record before any code of ours ran: no credential stays in it, even if refused below
        redaction.scrub_files(run_dir / run_files.HYDRA)
    world = launched_world_size(cfg)

    # Checks, before W&B starts and the model loads: a refusal is recorded in run.json. Those that need neither torch
    # nor transformers come before they load, so that a refused run says so in about a second.
    with _refusals_recorded(run_dir, rank0):
        config.validate(cfg, world)
        if (problems := config.gpu_only_problems(cfg)) and not nvml.cuda_devices():
            raise config.ConfigError(problems)
        wandb_logging.refuse_online_without_credentials(cfg)
        resume = checkpoints.plan(cfg, run_dir, rank0)  # refused before the data is built (its run.json is kept)
        with collector.paused_for_imports():  # torch, transformers and accelerate
            from colocated_grpo.resilience import preemption
            from colocated_grpo.training import build
        build.single_process_rendezvous(cfg)  # a plain `python train.py`: its own rendezvous port, as torchrun gives
        build.skip_deepspeed_cpu_shm_build(cfg)  # before GRPOConfig starts DeepSpeed's comm backend
        report_to = ["wandb"] if cfg.logger.backend == "wandb" and rank0 else []  # TRL logs to W&B from rank 0
        prepared = preflight.prepare(cfg, run_dir, report_to)  # the dataset, prompt lengths, TRL's own rules
        with collector.paused_for_imports():  # TRL's trainer and vLLM, for build_trainer
            import colocated_grpo.training.trainer  # noqa: F401
    if rank0 and (line := prompt_lengths.said(prepared.prompts)):
        log.warning("%s", line)
    resume_command = attempts.resume_command(run_dir)  # before vLLM's CPU platform rewrites LOCAL_WORLD_SIZE
    build.prepare_environment(cfg)

    # Training and its bookkeeping: run.json (this attempt, its status and error), W&B, SIGTERM and Ctrl-C, the process
    # group. A signal ends the run with TrainingInterrupted, a run that trained no step with NothingTrained, a full
    # disk with DiskFull, a GPU out of memory in training with TrainingMemoryError.
    record, wandb_run = _start_record(cfg, run_dir, rank0, world, prepared, resume)
    stopper, trainer = preemption.StopOnSignal(), None
    status, exit_code, error, interrupted = "failed", 1, None, None
    try:
        with stopper.installed():
            trainer = build.build_trainer(cfg, run_dir, prepared)
            record.note(distributed_type=trainer.accelerator.distributed_type.value)  # accelerate's word for it
            if (engine := trl_internals.engine_config(trainer)) is not None:  # eager: without torch.compile
                record.note(vllm_enforce_eager=bool(engine.model_config.enforce_eager))
            build.add_callbacks(trainer, cfg, run_dir, stopper)
            if stopper.signum is None:  # no SIGTERM or Ctrl-C came while the model and the engine loaded
                checkpoint = resume.checkpoint
                if checkpoint:  # transformers loads the optimizer's state onto accelerate's device, cpu:<rank> on CPU
                    restore_indexed_cpu_locations()
                trainer.train(resume_from_checkpoint=str(checkpoint.path) if checkpoint else None)
        interrupted = attempts.interruption(stopper, trainer.state, run_dir, resume_command)
        if interrupted is None and trainer.state.global_step == 0:
            raise NothingTrained(
                "training ended without training a step: the dataset holds fewer prompts than one generation batch "
                "(trainer.per_device_train_batch_size × processes × steps_per_generation / trainer.num_generations); "
                "use more rows (data.num_samples for the synthetic data) or a smaller batch"
            )
        status, exit_code = ("interrupted", interrupted.code) if interrupted else ("finished", 0)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM in start-up (signals.run_main)
        status, exit_code = "interrupted", getattr(stop, "code", 130)
        raise
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is no Exception
        # a GPU out of memory once the trainer is built (building it has explain_startup_error)
        oom = trainer is not None and out_of_memory.explain(
            exc, cfg, trainer.state.global_step + 1, checkpointing=trainer.args.gradient_checkpointing
        )
        error = _explain_disk_full(exc, run_dir, rank0) or oom or exc
        if error is not exc:
            raise error from exc
        raise
    finally:
        signals.ending()  # the runner's own handler is gone; start-up's would mislabel a SIGTERM now
        # Each part of the ending runs whatever another raised. A failure there is logged; it fails a run that
        # had finished (run.json and the exit say so), while an error that ended training stays the one reported.
        ending_failed: list[Exception] = []
        if wandb_run is not None:
            _ending_part("W&B's finish", lambda: wandb_run.finish(exit_code=exit_code), ending_failed)
        if ending_failed and status == "finished":
            status, error = "failed", ending_failed[0]

        def end_record():  # with the memory plan's estimate beside the most the device held (rank 0 writes it)
            peak = memory_plan.with_peak(prepared.memory, run_dir, resume.step) if rank0 else None
            record.end(status, error, memory_plan=peak)

        _ending_part("writing run.json", end_record, ending_failed)
        _ending_part("closing the process group", _close_process_group, ending_failed)
    if ending_failed and status != "interrupted":  # reached only when training itself ended without an error
        raise ending_failed[0]
    if interrupted is not None:
        if rank0:
            log.error("%s", interrupted)
        raise interrupted
    if rank0:
        log.info("%s", end_of_run_summary(run_dir, wandb_run))
    return run_dir


@contextmanager
def _refusals_recorded(run_dir: Path, main: bool):
    """Refused by its config or its run directory, its data cannot be built, or TRL or vLLM fail to import: run.json
    says so either way, and the Hydra record of a run the directory already held is put back."""
    try:
        yield
    except Exception as err:
        if main:
            attempts.record_refusal(run_dir, err, {"command": sys.argv, "overrides": hydra_internals.task_overrides()})
            run_dir_guard.restore_record(run_dir)
        _close_process_group()  # GRPOConfig may have started it
        raise


def _start_record(cfg: DictConfig, run_dir: Path, main: bool, world: int, prepared: preflight.Prepared, resume):
    """The run directory held, run.json's attempt started, the W&B run started: returns run.json's record and the
    W&B run."""
    if main:  # already held when Hydra started this process (resilience/run_dir_guard.py); held until it ends
        run_dir_guard.claim(run_dir)
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
    # W&B's mode asked for and used (offline when its server did not answer); the prompts' lengths and what was cut
    profile = config.length_profile(cfg)  # run.length_profile: the lengths vLLM was asked for
    record.start(
        wandb_run,
        wandb=wandb_outcome,
        prompts=prepared.prompts,
        length_profile=profile and profile.record(),
        memory_plan=prepared.memory,  # the estimate; the measured peak joins it at the end
    )
    return record, wandb_run


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


def launched_world_size(cfg: DictConfig) -> int:
    """The processes this run really has (torchrun's WORLD_SIZE, else one); warns when parallelism.nproc_per_node,
    which only tells a launcher how many to start, disagrees."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    wanted = int(cfg.parallelism.nproc_per_node)
    if wanted != here and run_files.is_main_process():
        log.warning(
            f"parallelism.nproc_per_node={wanted}, but this run has {here} process(es) on this node (world size "
            f"{world}): the world size is {world}, and per-GPU numbers count {world} GPU(s). "
            f"parallelism.nproc_per_node tells a launcher how many processes to start: torchrun "
            f"--nproc_per_node={wanted} train.py …, or python train.py -m … (the torchrun launcher)"
        )
    return world


def _ending_part(what: str, part, failed: list[Exception]) -> None:
    try:
        part()
    except Exception as exc:
        log.error("%s failed while the run ended: %s: %s", what, type(exc).__name__, exc)
        run_files.log_to_files(log, logging.ERROR, what, (type(exc), exc, exc.__traceback__))
        failed.append(exc)


def _close_process_group() -> None:
    dist = sys.modules.get("torch.distributed")  # a run refused before torch loaded has none
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _explain_disk_full(exc: BaseException, run_dir: Path, main: bool) -> disk_full.DiskFull | None:
    """DiskFull for a run out of space; rank 0 removes the save it cut short, freeing room to record the failure."""
    if last := checkpoints.latest(run_dir):
        then = f"run the same command again to resume from {last.path.name}"
    else:  # the run starts over, which the same command refuses once it holds metric rows or a cut save
        words = [w for w in attempts.resume_command(run_dir).split(" ") if not w.startswith("run.resume=")]
        command = " ".join([*words, "run.resume=restart"])
        then = f"start the run over from step 0 (no checkpoint is complete) with: {command}"
    full = disk_full.explain(exc, run_dir, then)
    if full is not None and main:
        checkpoints.remove_incomplete(run_dir)
    return full
