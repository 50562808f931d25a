"""Weights & Biases on rank 0: offline unless WANDB_MODE says otherwise, files inside the run directory, the same
W&B run continued when a run is resumed."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from colocated_grpo.resilience import wandb_rewind
from colocated_grpo.resilience.checkpoints import Resume
from colocated_grpo.resilience.redaction import redact

log = logging.getLogger(__name__)


def start(cfg: DictConfig, run_dir: Path, metadata: dict, resume: Resume):
    """Start the W&B run (rank 0 only) that TRL's reporting will then use; None when W&B is off.

    When resuming, the W&B run of the earlier attempts is continued (resume="allow") rather than started anew, with
    no step missing up to the checkpoint.
    """
    if cfg.logger.backend != "wandb":
        return None
    run = _init(cfg, run_dir, metadata, resume.wandb_id)
    if resume.resuming and (backfilled := wandb_rewind.backfill(run, run_dir, resume.step)):
        log.info("W&B: logged steps %s from metrics.jsonl (missing from the earlier segments)", backfilled)
    return run


def _init(cfg: DictConfig, run_dir: Path, metadata: dict, run_id: str | None):
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
