"""What `train.py` runs: a server placement's first process orchestrates (launch/server_placement.py), every other
process trains. A failure ends the process here, reported once per launch: errors that explain themselves as one
message, anything else with its traceback."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from omegaconf import DictConfig

from colocated_grpo.compat.hydra import in_process_multirun_launcher, output_dir
from colocated_grpo.launch import server_placement
from colocated_grpo.resilience import process_end
from colocated_grpo.resilience.checkpoints import ResumeError
from colocated_grpo.resilience.disk_full import DiskFull
from colocated_grpo.resilience.nonfinite import NonFiniteError
from colocated_grpo.resilience.out_of_memory import TrainingMemoryError
from colocated_grpo.resilience.preemption import TrainingInterrupted
from colocated_grpo.resilience.startup_errors import StartupMemoryError
from colocated_grpo.training import runner
from colocated_grpo.training.config import ConfigError
from colocated_grpo.training.data import DataError
from colocated_grpo.training.rewards import RewardError
from colocated_grpo.training.wandb_logging import WandbError

# Errors whose message says what to change: no traceback (but a reward's own, the cause of a RewardError, is shown).
EXPLAINED = (
    ConfigError,
    DataError,
    DiskFull,
    ResumeError,
    RewardError,
    NonFiniteError,
    StartupMemoryError,
    TrainingMemoryError,
    runner.NothingTrained,
    server_placement.ServerError,
    WandbError,
)


def main(cfg: DictConfig) -> None:
    os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")  # W&B's Weave advertisement
    # transformers' FutureWarnings about the `gradient_checkpointing` names that TRL still reads
    warnings.filterwarnings("ignore", message=r"`(is_)?gradient_checkpointing` is deprecated", category=FutureWarning)
    process_end.stop_with_torchrun_agent()
    run_dir = Path(output_dir()).resolve()
    try:
        if launcher := in_process_multirun_launcher():
            raise ConfigError(
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
            runner.run(cfg)
            # Ends at once: the interpreter's teardown can abort on vLLM's native threads (exit -6, "terminate called")
            process_end.exit_now(0)
    except TrainingInterrupted as stopped:  # already said, with the command that resumes it
        process_end.exit_now(stopped.code)
    except KeyboardInterrupt as stop:  # SIGTERM in start-up, a signal repeated in training, a second Ctrl-C
        if runner.is_main_process():
            print(str(stop) or "KeyboardInterrupt: stopped at once, without a checkpoint", flush=True)
        process_end.exit_now(getattr(stop, "code", 130))
    except Exception as exc:
        process_end.begin()  # torchrun's SIGTERM (another rank failed too) must not cut this report short
        process_end.report_failure(exc, explained=isinstance(exc, EXPLAINED), show_cause=isinstance(exc, RewardError))
        process_end.exit_now(1)
