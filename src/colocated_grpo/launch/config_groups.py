"""The configs as a user meets them: a group's old name on the command line is refused in one line that names the new
one, the composed default config is kept as a file (docs/config_reference.yaml) with the groups that set each of its
sections, and `${run_start:FORMAT}` names the run directory.

    colocated-grpo config-reference        # writes docs/config_reference.yaml again after a change in conf/
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from colocated_grpo.resilience import process_end

RENAMED = {"vllm": "placement"}  # old group name: new group name
REFERENCE = Path("docs") / "config_reference.yaml"  # in the checkout
REGENERATE = "colocated-grpo config-reference"


class RenamedGroup(ValueError):
    """An override that names a config group by its old name."""


def renamed(override: str) -> str | None:
    """What to write instead of an override of a renamed group (`vllm=server`, `+vllm=…`, `~vllm`, `vllm@pkg=…`),
    read by Hydra's own override parser; None for any other argument (`-m`, `--cfg job`, another key)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_override(override)
    except HydraException:  # not an override (-m, --cfg): Hydra judges it
        return None
    old = parsed.key_or_group
    if old not in RENAMED:
        return None
    rest = override.strip()[len(parsed.get_key_element()) :]  # `=value`, as written, or nothing
    package = f"@{parsed.package}" if parsed.package is not None else ""
    new = ("~" if parsed.is_delete() else "") + RENAMED[old] + package + rest  # the group is a default: no `+`
    return f"the config group `{old}` is now `{RENAMED[old]}`: write {new}"


def refuse_renamed_groups(argv: list[str]) -> None:
    """Before Hydra parses `argv`: end the process in one line (once per launch) when an override names a renamed
    group, instead of Hydra's "Could not override" error."""
    for override in argv:
        if message := renamed(override):
            process_end.report_failure(RenamedGroup(message), explained=True)
            process_end.exit_now(1)


def register_run_start() -> None:
    """Make `${run_start:FORMAT}` (strftime FORMAT, local time) available to the configs: the start of the torchrun
    agent all of a node's ranks share (their parent), or of the process itself when torchrun did not start it. Hydra's
    `${now:…}` is resolved by each process: ranks that start in different seconds would name different directories."""
    import psutil
    from omegaconf import OmegaConf

    started = psutil.Process(os.getppid() if process_end.torchrun_worker() else os.getpid()).create_time
    OmegaConf.register_new_resolver(
        "run_start", lambda fmt: time.strftime(fmt, time.localtime(started())), replace=True, use_cache=True
    )


def reference(repo: Path) -> str:
    """The composed default config (`python train.py --cfg job`), each top-level section headed by the configs
    that set it."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    conf = repo.resolve() / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("train")
        defaults = GlobalHydra.instance().config_loader().compute_defaults_list("train", [], RunMode.RUN).defaults
    sources = []  # (what names the config, the top-level keys it sets), in the order Hydra merges them
    for default in defaults:
        path = conf / f"{default.config_path}.yaml"
        if not path.exists():  # Hydra's own configs, and nodes registered in code (types, no values)
            continue
        group, _, option = default.config_path.rpartition("/")
        name = f"{group}={option} (conf/{default.config_path}.yaml)" if group else f"conf/{path.name}"
        keys = {default.package.split(".")[0]} if default.package else set(OmegaConf.load(path)) - {"defaults"}
        sources.append((name, keys))
    lines = [
        "# The composed default config: what `python train.py --cfg job` prints with no overrides, each top-level",
        "# section headed by the configs that set it (conf/<group>/<option>.yaml, merged in this order: a later one",
        f"# wins). Generated: after a change in conf/, run `{REGENERATE}`;",
        "# tests/test_launch_config_groups.py fails while this file is stale.",
    ]
    for key in cfg:
        setters = [name for name, keys in sources if key in keys]
        lines += ["", f"# set by: {', '.join(setters)}", OmegaConf.to_yaml({key: cfg[key]}).rstrip()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    from colocated_grpo.provenance import checkout, command_parser  # train.py imports this module: only what it needs

    description = f"Write {REFERENCE}: the composed default config, each section with the configs that set it."
    command_parser("colocated_grpo.launch.config_groups", description, prog).parse_args(argv)
    repo = checkout()
    path = repo / REFERENCE
    path.write_text(reference(repo))
    print(path)


if __name__ == "__main__":
    main()
