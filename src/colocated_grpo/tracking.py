"""Weights & Biases on rank 0: offline unless WANDB_MODE says otherwise, files inside the run directory."""

from __future__ import annotations

import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from colocated_grpo.redaction import redact


def start(cfg: DictConfig, run_dir: Path, metadata: dict, run_id: str | None = None):
    """Start the W&B run (rank 0 only) that TRL's reporting will then use; None when W&B is off.

    `run_id`: the W&B run of an earlier attempt of this run, continued (resume="allow") rather than started anew.
    """
    if cfg.logger.backend != "wandb":
        return None
    os.environ.setdefault("WANDB_MODE", "offline")
    import wandb

    return wandb.init(
        project=cfg.logger.project,
        entity=cfg.logger.get("entity"),
        group=cfg.logger.get("group"),
        tags=list(cfg.logger.get("tags") or []),
        name=run_dir.name,
        dir=str(run_dir),
        id=run_id,
        resume="allow" if run_id else None,
        config=redact({"cfg": OmegaConf.to_container(cfg, resolve=True), **metadata}),
    )


def finish(run, exit_code: int) -> None:
    if run is not None:
        run.finish(exit_code=exit_code)
