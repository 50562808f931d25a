"""The W&B side of a resumed run: the same run id, every step logged once, none missing.

W&B writes each run segment (one per attempt) to a transaction log (compat/wandb.py reads it); `wandb sync` uploads
offline segments later, in order, as one run. Two things go wrong when a process is killed:

- it has logged steps after its last checkpoint, which the resumed attempt logs again: `rewind` cuts offline
  segments back to the moment that checkpoint was saved, as if the process had died right then;
- W&B writes the transaction log every few seconds, so the last steps before the kill may never reach it:
  `backfill` logs the steps up to the checkpoint that metrics.jsonl (the source of truth) has and the earlier
  segments lack into the new segment, before training continues.

Online segments are already on the server; rows they hold beyond the checkpoint are reported, not removed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from transformers import TrainerCallback

from colocated_grpo import run_files
from colocated_grpo.compat.wandb import history, history_row, is_history, records, trainer_metric_names, truncate
from colocated_grpo.run_files import STEP_KEY, read_json, read_jsonl, write_json

log = logging.getLogger(__name__)

MARKER = "wandb_step.json"  # written into each checkpoint: which W&B segment saved it, at which W&B step


def segments(wandb_dir: Path, run_id: str) -> list[Path]:
    """This run's segment directories (offline-run-… and run-…), oldest first."""
    found = [p for p in Path(wandb_dir).glob(f"*run-*-{run_id}") if p.is_dir()]
    return sorted(found, key=lambda p: p.name.split("-")[-2])  # offline-run-YYYYMMDD_HHMMSS-ID


def rewind(wandb_dir: Path, run_id: str, step: int, marker: dict | None) -> dict[str, int]:
    """Cut this run's offline segments back to checkpoint `step`; returns the history rows dropped per segment.

    With the checkpoint's marker the cut is exact: in the segment that saved it, before the first row logged after
    it was saved; later segments lose every row. Without one (a checkpoint saved while W&B was off, or a run that
    never checkpointed), rows after `step` go (all rows when step is 0).

    Every segment is read before any is cut: a log this W&B does not know (compat.wandb.UnknownFormat, raised to
    the caller) leaves them all as they were.
    """
    order = [s.name for s in segments(wandb_dir, run_id)]
    saved_in = (marker or {}).get("segment")
    cuts: dict[str, tuple[Path, int, int]] = {}
    for name in order:
        if saved_in in order:
            position, saver = order.index(name), order.index(saved_in)
            if position < saver:
                continue
            first_dropped = _after_wandb_step(marker["step"]) if position == saver else (lambda row: True)
        else:
            first_dropped = _after_train_step(step)
        log_file = Path(wandb_dir) / name / f"run-{run_id}.wandb"
        cut, count = None, 0
        for offset, record in records(log_file) if log_file.exists() else ():
            if is_history(record):
                if cut is None and first_dropped(history_row(record)):
                    cut = offset
                count += cut is not None
        if cut is not None:
            cuts[name] = (log_file, cut, count)
    dropped: dict[str, int] = {}
    for name, (log_file, cut, count) in cuts.items():
        if name.startswith("offline-"):
            truncate(log_file, cut)
            dropped[name] = count
        else:
            log.warning(
                "W&B already holds %d rows that run %s logged after checkpoint %d (segment %s, online); they stay "
                "in W&B. metrics.jsonl in the run directory has every step once.",
                count,
                run_id,
                step,
                name,
            )
    return dropped


def _after_wandb_step(wandb_step: int):
    return lambda row: row["_step"] >= wandb_step


def _after_train_step(step: int):
    return lambda row: step == 0 or (row.get(STEP_KEY) is not None and row[STEP_KEY] > step)


def backfill(run, run_dir: Path, step: int) -> list[int]:
    """Log into `run` (the new segment) the steps up to `step` that metrics.jsonl has and no earlier offline
    segment kept; returns them. Skipped when an earlier segment was online (the server may hold rows we cannot see)."""
    if getattr(run, "disabled", False):
        return []
    current = Path(run.dir).parent.name
    earlier = [s for s in segments(Path(run_dir) / "wandb", run.id) if s.name != current]
    metrics = Path(run_dir) / run_files.METRICS
    if any(not s.name.startswith("offline-") for s in earlier) or not metrics.exists():
        return []
    present = {
        row[STEP_KEY]
        for s in earlier
        for log_file in s.glob(f"run-{run.id}.wandb")
        for row in history(log_file)
        if any(k.startswith("train/") and k != STEP_KEY for k in row)
    }
    logged = []
    for record in read_jsonl(metrics):
        s = record.get(STEP_KEY)
        if s is None or s > step or s in present:
            continue
        values = {k: _number(v) for k, v in record.items() if k != STEP_KEY and v is not None}
        run.log({**trainer_metric_names(values), STEP_KEY: s})
        logged.append(s)
    return logged


def _number(value):
    """metrics.jsonl writes infinities as strings (JSON has none); W&B should get the numbers back."""
    return float(value) if value in ("inf", "-inf") else value


def read_marker(checkpoint: Path | None) -> dict | None:
    return None if checkpoint is None else read_json(Path(checkpoint) / MARKER)


class RecordWandbStep(TrainerCallback):
    """On rank 0, note in each checkpoint the W&B segment and step at which it was saved (see `rewind`)."""

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        import wandb

        run = wandb.run
        checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if run is None or getattr(run, "disabled", False) or not checkpoint.is_dir():
            return
        write_json(checkpoint / MARKER, {"id": run.id, "segment": Path(run.dir).parent.name, "step": run.step})
