"""The same frames as analysis/frames.py and analysis/tables.py, read from the W&B API instead of the run files
(needs network and W&B credentials)."""

from __future__ import annotations

from colocated_grpo.analysis.tables import COLUMNS, _numeric, _select, placement_settings, summary_row
from colocated_grpo.run_files import STEP_KEY


def load_wandb_run(path: str, api=None):
    """The metrics of a W&B run ("entity/project/run_id") as load_run frames them: one row per `train/global_step`,
    TRL's `train/` prefix removed (`train/reward` → `reward`). Needs network and W&B credentials."""
    import pandas as pd

    api = api or _wandb_api()
    by_step: dict[int, dict] = {}
    for row in api.run(path).scan_history():  # TRL's and the telemetry's rows of one step are separate
        step = row.get(STEP_KEY)
        if step is None:
            continue
        merged = by_step.setdefault(int(step), {STEP_KEY: int(step)})
        for key, value in row.items():
            if value is not None and not key.startswith("_") and key != STEP_KEY:
                merged.setdefault(key.removeprefix("train/"), value)
    frame = pd.DataFrame([by_step[s] for s in sorted(by_step)])
    return frame if STEP_KEY in frame else pd.DataFrame(columns=[STEP_KEY])


def load_wandb_sweep(project: str, group: str | None = None, api=None):
    """The runs of a W&B project ("entity/project"), or of one sweep's group (`logger.group`, by default the sweep
    directory's name), as load_sweep frames them: placement from each run's config, numbers from its summary (the
    telemetry's steady-state means). Needs network and W&B credentials."""
    import pandas as pd

    api = api or _wandb_api()
    rows = []
    for run in api.runs(project, filters={"group": group} if group else None):
        cfg = run.config.get("cfg") or {}
        rows.append(
            {
                "job": None,
                "overrides": run.name,
                "status": run.state,
                "exit_code": None,
                **placement_settings(lambda key, cfg=cfg: _select(cfg, key), run.config.get("world_size")),
                **summary_row(dict(run.summary_metrics), []),
                "source": "wandb",
                "note": None,
                "dir": "/".join(run.path),
            }
        )
    return _numeric(pd.DataFrame(rows, columns=list(COLUMNS)))


def _wandb_api():
    import wandb

    return wandb.Api()
