"""What `train.py` runs: the one choice made above the training runner. A server placement's first process only
orchestrates (a vLLM server and a torchrun trainer, launch/server_placement.py); every other process trains."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from colocated_grpo.compat.hydra import in_process_multirun_launcher, output_dir
from colocated_grpo.launch import server_placement
from colocated_grpo.training import runner
from colocated_grpo.training.config import ConfigError


def main(cfg: DictConfig) -> None:
    if launcher := in_process_multirun_launcher():
        raise ConfigError(
            [
                f"hydra/launcher={launcher} runs every job of this multirun inside one process, but a job holds one "
                "process group and one vLLM engine for the life of its process, and a finished job ends its process "
                "(so later jobs would never run); drop hydra/launcher=… to use the default, hydra/launcher=torchrun "
                "(a fresh torchrun per job), or use hydra/launcher=torchrun_slurm on a cluster"
            ]
        )
    if server_placement.is_launcher(cfg):
        server_placement.run_placement(cfg, Path(output_dir()).resolve())
    else:
        runner.run_and_exit(cfg)
