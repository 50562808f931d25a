"""What we use of Hydra beyond its public API: the running job's overrides and output directory (HydraConfig), and
the job-directory name Hydra derives from overrides (`hydra._internal`), which the sweep launchers reuse."""

from __future__ import annotations

from hydra.core.hydra_config import HydraConfig


def task_overrides() -> list[str] | None:
    """The command-line overrides of this job (None outside Hydra)."""
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:
        return None


def output_dir() -> str:
    """The running job's output directory (hydra.run.dir, or the sweep job's directory)."""
    return HydraConfig.get().runtime.output_dir


def in_process_multirun_launcher() -> str | None:
    """The launcher's name when this job runs in a multirun's own process (Hydra's basic launcher), else None."""
    from hydra.types import RunMode

    config = HydraConfig.get()
    if config.mode != RunMode.MULTIRUN:
        return None
    return config.runtime.choices.get("hydra/launcher") or str(config.launcher.get("_target_"))


def override_dirname(overrides: list[str], spec) -> str:
    """Hydra's `hydra.job.override_dirname` of `overrides`, with `spec` = hydra.job.config.override_dirname."""
    from hydra._internal.config_loader_impl import get_overrides_dirname
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return get_overrides_dirname(parsed, list(spec.exclude_keys), spec.item_sep, spec.kv_sep)
