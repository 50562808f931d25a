"""The W&B side of a resumed run: the same run id, every step logged once, none missing. Each attempt writes a W&B
segment (a transaction log, compat/wandb.py) that `wandb sync` uploads in order as one run; after a kill, `rewind`
cuts the rows logged after the last checkpoint and `backfill` logs the steps that never reached the log.

Why not W&B's own ways: a new run per attempt in one group would show a run that was preempted twice as three
fragments whose step ranges overlap where a killed attempt logged past its checkpoint, with three summaries; the
sweep tables and notebooks read one run per job. W&B's `resume_from` (rewind) truncates only online runs, on the
server, and is a private preview; the offline runs this project logs by default have no server to rewind them. So
offline segments are cut here, before `wandb sync`; an online run keeps rows logged after the checkpoint (W&B cannot
be cut from here) and says so, and metrics.jsonl holds every step once either way."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from colocated_grpo import run_files
from colocated_grpo.compat.wandb import history, history_row, is_history, records, trainer_metric_names
from colocated_grpo.run_files import STEP_KEY, read_jsonl, write_json

log = logging.getLogger(__name__)

MARKER = "wandb_step.json"  # written into each checkpoint: which W&B segment saved it, at which W&B step


def segments(wandb_dir: Path, run_id: str) -> list[Path]:
    """This run's segment directories (offline-run-… and run-…), oldest first."""
    found = [p for p in Path(wandb_dir).glob(f"*run-*-{run_id}") if p.is_dir()]
    return sorted(found, key=lambda p: p.name.split("-")[-2])  # offline-run-YYYYMMDD_HHMMSS-ID


def rewind(wandb_dir: Path, run_id: str, step: int, checkpoint: Path | None) -> dict[str, int]:
    """Cut this run's offline segments back to `checkpoint` (of `step`, or None); returns the rows dropped per segment:
    with the checkpoint's marker, from the first row logged after it was saved and all rows of later segments; without
    one (saved while W&B was off, or no checkpoint), the rows after `step` (all when step is 0). All segments are read
    before any is cut: an unknown log format (compat.wandb.UnknownFormat) changes none."""
    marker = run_files.read_json(checkpoint / MARKER) if checkpoint else None
    order = [s.name for s in segments(wandb_dir, run_id)]
    saver = order.index(marker["segment"]) if (marker or {}).get("segment") in order else None

    def after_checkpoint(position: int, row: dict) -> bool:
        if saver is None:  # no marker: the rows after the checkpoint's train step
            return step == 0 or (row.get(STEP_KEY) is not None and row[STEP_KEY] > step)
        return position > saver or row["_step"] >= marker["step"]

    cuts: dict[str, tuple[Path, int, int]] = {}
    for position, name in enumerate(order):
        if saver is not None and position < saver:
            continue
        log_file = Path(wandb_dir) / name / f"run-{run_id}.wandb"
        cut, count = None, 0
        for offset, record in records(log_file) if log_file.exists() else ():
            if is_history(record):
                if cut is None and after_checkpoint(position, history_row(record)):
                    cut = offset
                count += cut is not None
        if cut is not None:
            cuts[name] = (log_file, cut, count)
    dropped: dict[str, int] = {}
    for name, (log_file, cut, count) in cuts.items():
        if name.startswith("offline-"):
            os.truncate(log_file, cut)  # as if the writer had died right before the first row cut
            dropped[name] = count
        else:
            log.warning(
                f"W&B already holds {count} rows that run {run_id} logged after checkpoint {step} (segment {name}, "
                "online); they stay in W&B. metrics.jsonl in the run directory has every step once."
            )
    return dropped


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
        values = {k: v for k, v in record.items() if k != STEP_KEY and v is not None}
        values = {k: float(v) if v in ("inf", "-inf") else v for k, v in values.items()}  # JSON's infinities: strings
        run.log({**trainer_metric_names(values), STEP_KEY: s})
        logged.append(s)
    return logged


def record_wandb_step_callback():
    """A trainer callback: on rank 0, note in each checkpoint the W&B segment and step at which it was saved (see
    `rewind`), and start the segment's `train/global_step` at the trainer's step. (Built here so that this module
    imports without transformers: a refused run never loads it.)"""
    import wandb
    from transformers import TrainerCallback

    class RecordWandbStep(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            # W&B labels a row without the step key (TRL's profiling rows, logged during a step) with the last value
            # of the key logged in this process (transformers' define_metric step_sync): 0 before any, which a
            # resumed segment's first rows would get. Joined to the next row (commit=False), it adds none.
            run = wandb.run
            if state.is_world_process_zero and run is not None and not getattr(run, "disabled", False):
                run.log({STEP_KEY: state.global_step}, commit=False)

        def on_save(self, args, state, control, **kwargs):
            run = wandb.run
            checkpoint = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if not state.is_world_process_zero or run is None or getattr(run, "disabled", False):
                return
            if checkpoint.is_dir():
                write_json(checkpoint / MARKER, {"id": run.id, "segment": Path(run.dir).parent.name, "step": run.step})

    return RecordWandbStep()
