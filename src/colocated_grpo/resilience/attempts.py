"""A run over its attempts: the run directory brought back to the checkpoint an attempt starts from, run.json
(status, errors, W&B id) and the message that says how to resume."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from colocated_grpo import run_files
from colocated_grpo.compat.hydra import task_overrides
from colocated_grpo.compat.wandb import UnknownFormat
from colocated_grpo.resilience import checkpoints, disk_full, redaction, wandb_rewind
from colocated_grpo.resilience.signals import TrainingInterrupted

log = logging.getLogger(__name__)

RESUME_COMMAND_ENV = "COLOCATED_GRPO_RESUME_COMMAND"  # set by a server placement's orchestrator for its trainer


def prepare_run_dir(cfg: DictConfig, run_dir: Path, resume: checkpoints.Resume) -> None:
    """Rank 0: remove the saves cut short, cut the run files and W&B segments back to the checkpoint resumed from,
    then record the config. A disk still full is DiskFull, the cut save's space freed first."""
    try:
        _prepare_run_dir(cfg, run_dir, resume)
    except OSError as err:
        if (full := disk_full.explain(err, run_dir, "run the same command again")) is None:
            raise
        raise full from err


def _prepare_run_dir(cfg: DictConfig, run_dir: Path, resume: checkpoints.Resume) -> None:
    if resume.resuming:
        removed = checkpoints.remove_incomplete(run_dir)  # first: a save that a full disk cut short frees its space
        dropped = checkpoints.trim_run_files(run_dir, resume.step)
        rewound = {}
        if resume.wandb_id:
            checkpoint = resume.checkpoint.path if resume.checkpoint else None
            try:
                rewound = wandb_rewind.rewind(run_dir / "wandb", resume.wandb_id, resume.step, checkpoint)
            except UnknownFormat as err:
                log.warning(
                    f"W&B: run {resume.wandb_id} is not continued ({err}); this attempt logs to a new W&B run in the "
                    "same group, with the steps up to the checkpoint from metrics.jsonl, which keeps every step"
                )
                resume.previous["wandb_id"] = None
        where = resume.checkpoint.path.name if resume.checkpoint else "the start (no checkpoint)"
        log.info(
            f"resuming {run_dir} from {where}, step {resume.step}; records of later steps dropped: "
            f"{dropped or 'none'}; W&B rows dropped: {rewound or 'none'}; incomplete checkpoints removed: "
            f"{removed or 'none'}"
        )
    if cfg.trainer.get("trust_remote_code"):
        log.warning("trainer.trust_remote_code=true: code shipped with the model repository will run here")
    tree = redaction.redact(OmegaConf.to_container(cfg, resolve=True))
    run_files.write_text(run_dir / run_files.CONFIG, OmegaConf.to_yaml(OmegaConf.create(tree)))


class RunRecord:
    """run.json over the attempts of one run: the first start, the W&B run id, and each attempt's start step,
    status and error. Rank 0 writes it; every file write is redacted."""

    def __init__(self, run_dir: Path, metadata: dict, resume: checkpoints.Resume, write: bool):
        self.path, self.write = run_dir / run_files.RUN, write
        attempts = _ended(resume.previous)["attempts"]
        self.attempt = {"started": run_files.now(), "from_step": resume.step}
        self.data = {
            **metadata,
            "status": "running",
            "started": resume.previous.get("started") or self.attempt["started"],
            "wandb_id": resume.wandb_id,
            "attempts": [*attempts, self.attempt],
        }

    def start(self, wandb_run, **fields) -> None:
        """The attempt has started: its W&B run, and what else is known by now (fields that are None left out)."""
        if wandb_run is not None:
            self.data["wandb_id"] = wandb_run.id
        self.note(**{key: value for key, value in fields.items() if value is not None})

    def note(self, **fields) -> None:
        """Add what is known only once training is set up (e.g. how accelerate distributes the model)."""
        self.data.update(fields)
        self._save()

    def end(self, status: str, error: BaseException | None = None, **fields) -> None:
        """The attempt has ended: its status and error, and what is known only at the end (fields that are None left
        out: e.g. the memory plan beside the measured peak)."""
        self.attempt.update(status=status, ended=run_files.now())
        self.data.update({key: value for key, value in fields.items() if value is not None})
        self.data.update(status=status, ended=self.attempt["ended"])
        if error is not None:
            self.data["error"] = self.attempt["error"] = f"{type(error).__name__}: {error}"
        self._save()

    def _save(self) -> None:
        if self.write:
            run_files.write_json(self.path, redaction.redact(self.data))


def _ended(record: dict) -> dict:
    """A run record whose attempts all have an end: one that ended without recording it (SIGKILL, OOM killer, node
    loss) died, and so did the run where it is still recorded as running."""
    ended = {**record, "attempts": [{**a, "status": a.get("status", "died")} for a in record.get("attempts", [])]}
    if record.get("status") == "running":
        ended["status"] = "died"
    return ended


def record_refusal(run_dir: Path, error: BaseException, metadata: dict) -> None:
    """Rank 0, for a run that ended before it started (refused by its config, or its data failed to build): run.json
    says so, unless the directory already holds a run, whose record stays as it is but for the end of a killed
    attempt (no process of that run is alive: this launch holds the directory)."""
    path = run_dir / run_files.RUN
    if path.exists():
        if (previous := run_files.read_json(path) or {}).get("status") == "running":
            run_files.write_json(path, _ended(previous))
        return
    now = run_files.now()
    record = {**metadata, "status": "failed", "started": now, "ended": now, "error": f"{type(error).__name__}: {error}"}
    record[checkpoints.MARKED] = True  # what the next launch keeps: every checkpoint of this run will be marked
    run_files.write_json(path, redaction.redact(record))


def resume_command(run_dir: Path) -> str:
    """How to continue this run, as a command line (a server placement's trainer: its orchestrator's, in
    RESUME_COMMAND_ENV). Per node: the world over torchrun's nodes (vLLM's CPU platform rewrites LOCAL_WORLD_SIZE)."""
    if given := os.environ.get(RESUME_COMMAND_ENV):
        return given
    world, nodes = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    return checkpoints.launch_command(run_dir, task_overrides(), world, world // nodes)


def interruption(stopper, state, run_dir: Path, command: str) -> TrainingInterrupted | None:
    """The exit to take after training returned, when a signal that `stopper` (preemption.StopOnSignal) caught cut it
    short (None when every step ran). A signal before the first step (while the model and the engine load) always
    interrupts: nothing was trained."""
    if stopper.signum is None or (stopper.stopped_at is not None and state.global_step >= state.max_steps):
        return None
    name = signal.Signals(stopper.signum).name
    if stopper.stopped_at is None:
        last = checkpoints.latest(run_dir)
        saved = f"before its first step; nothing new to save (latest checkpoint: {last.path if last else 'none'})"
    else:
        checkpoint = run_dir / f"checkpoint-{stopper.stopped_at}"
        saved = f"after step {stopper.stopped_at} of {state.max_steps}: checkpoint saved to {checkpoint}"
    said = f"training stopped by {name} {saved}; run files flushed and W&B run finished. Resume with: {command}"
    return TrainingInterrupted(stopper.signum, said)
