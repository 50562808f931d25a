"""Weights & Biases on rank 0: offline unless WANDB_MODE says otherwise, files inside the run directory, the same
W&B run continued on resume. Online without credentials is refused before anything loads; a server that does not
answer within `logger.init_timeout_s` means offline instead (run.json's `wandb` says which mode was asked and used)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from colocated_grpo.compat.wandb import missing_credentials
from colocated_grpo.compat.wandb import server as wandb_server
from colocated_grpo.resilience import wandb_rewind
from colocated_grpo.resilience.checkpoints import Resume
from colocated_grpo.resilience.redaction import redact

log = logging.getLogger(__name__)

ONLINE = ("online", "run", "shared")  # W&B's modes that need its server ("run" is its old name for online)
INIT_TIMEOUT_S = 20.0  # logger.init_timeout_s when unset; W&B's own default waits 90 s, then fails the run


class WandbError(RuntimeError):
    """W&B cannot run as asked; the message is one line that says what to do."""


def asked_mode() -> str:
    return os.environ.get("WANDB_MODE", "offline")


def refuse_online_without_credentials(cfg: DictConfig) -> None:
    """Every rank, with the config checks: W&B online with no API key stops the run before anything loads."""
    if cfg.logger.backend != "wandb" or asked_mode() not in ONLINE:
        return
    if (problem := missing_credentials()) is not None:
        raise WandbError(
            f"W&B online needs an API key ({problem}): `wandb login` or WANDB_API_KEY; "
            "or use WANDB_MODE=offline, then `wandb sync`"
        )


def start(cfg: DictConfig, run_dir: Path, metadata: dict, resume: Resume):
    """Start the W&B run (rank 0) that TRL then reports to: (run, run.json's `wandb`), or (None, None) when off.
    A resumed run continues the earlier attempts' W&B run, with every step up to the checkpoint."""
    if cfg.logger.backend != "wandb":
        return None, None
    run, outcome = _init(cfg, run_dir, metadata, resume.wandb_id)
    if resume.resuming and (backfilled := wandb_rewind.backfill(run, run_dir, resume.step)):
        log.info("W&B: logged steps %s from metrics.jsonl (missing from the earlier segments)", backfilled)
    return run, outcome


def _init(cfg: DictConfig, run_dir: Path, metadata: dict, run_id: str | None):
    os.environ.setdefault("WANDB_MODE", "offline")
    import wandb

    asked = asked_mode()
    timeout = float(cfg.logger.get("init_timeout_s") or INIT_TIMEOUT_S)
    logger = cfg.logger
    kwargs = dict(project=logger.project, entity=logger.get("entity"), group=logger.get("group"), name=run_dir.name)
    kwargs.update(tags=list(logger.get("tags") or []), dir=str(run_dir), id=run_id, resume="allow" if run_id else None)
    kwargs["config"] = redact({"cfg": OmegaConf.to_container(cfg, resolve=True), **metadata})
    started = time.monotonic()
    try:
        # quiet: no history block at the end (our own summary follows)
        run = wandb.init(**kwargs, settings=wandb.Settings(init_timeout=timeout, quiet=True))
        return run, {"asked": asked, "mode": asked}
    except wandb.errors.CommError as err:
        if asked not in ONLINE:
            raise
        waited, reason = time.monotonic() - started, (str(err).splitlines() or [type(err).__name__])[0]
        # W&B retries an unreachable server until init_timeout; an answer it does not retry (401) is refused
        if not (waited >= timeout or reason.startswith("Timed out")):
            raise WandbError(
                f"W&B online: {wandb_server()} refused the run ({reason}); check WANDB_API_KEY or `wandb login`, "
                "or use WANDB_MODE=offline, then `wandb sync`"
            ) from err
    # A new offline run (the failed one's id stays taken here; a resumed run backfills it), silent: the warning says it
    run = wandb.init(**{**kwargs, "id": None, "resume": None}, mode="offline", settings=wandb.Settings(silent=True))
    log.warning(
        f"W&B: no answer from {wandb_server()} within {waited:.0f} s ({reason}); logging offline instead, upload "
        f"later with: wandb sync {Path(run.dir).parent}"
    )
    return run, {"asked": asked, "mode": "offline", "reason": reason, "waited_s": round(waited, 1)}
