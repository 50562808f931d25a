"""TrainerCallback that writes every logged step to metrics.jsonl on rank 0 (one line per step; the trainer's
end-of-training totals go to trainer_summary.json instead)."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from colocated_grpo.run_files import JsonlWriter, write_json


class MetricsFileCallback(TrainerCallback):
    """Mirror of what TRL logs, keyed by `train/global_step` like the W&B run, one flushed line per log call."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.writer: JsonlWriter | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        if "train_runtime" in logs:
            write_json(self.run_dir / "trainer_summary.json", {"train/global_step": state.global_step, **logs})
            return
        if self.writer is None:
            self.writer = JsonlWriter(self.run_dir / "metrics.jsonl")
        self.writer.write({"train/global_step": state.global_step, **logs})

    def on_train_end(self, args, state, control, **kwargs):
        if self.writer is not None:
            self.writer.close()
            self.writer = None
