"""What `train.py` runs: the one choice made above the training runner. A server placement's first process only
orchestrates (a vLLM server and a torchrun trainer, launch/server.py); every other process trains."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from colocated_grpo.compat.hydra import output_dir
from colocated_grpo.launch import server
from colocated_grpo.training import runner


def main(cfg: DictConfig) -> None:
    if server.is_launcher(cfg):
        server.run_placement(cfg, Path(output_dir()).resolve())
    else:
        runner.run_and_exit(cfg)
