"""What `train.py` runs: the one choice made above the training runner. A server placement's first process only
orchestrates (a vLLM server and a torchrun trainer, launch/server_placement.py); every other process trains."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from colocated_grpo.compat.hydra import output_dir
from colocated_grpo.launch import server_placement
from colocated_grpo.training import runner


def main(cfg: DictConfig) -> None:
    if server_placement.is_launcher(cfg):
        server_placement.run_placement(cfg, Path(output_dir()).resolve())
    else:
        runner.run_and_exit(cfg)
