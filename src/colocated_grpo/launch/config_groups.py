"""The config groups as a user meets them: a group's old name on the command line is refused in one line that names
the new one."""

from __future__ import annotations

import re

from colocated_grpo.resilience import console

RENAMED = {"vllm": "placement"}  # old group name: new group name


class RenamedGroup(ValueError):
    """An override that names a config group by its old name."""


def renamed(override: str) -> str | None:
    """What to write instead of an override of a renamed group (`vllm=server`, `+vllm=…`, `~vllm`, `vllm@pkg=…`);
    None for any other argument."""
    match = re.fullmatch(r"(\+{1,2}|~)?(\w+)(@[^=]*)?(=.*)?", override)
    if not match or match[2] not in RENAMED:
        return None
    prefix, old, package, value = match.groups()
    new = ("~" if prefix == "~" else "") + RENAMED[old] + (package or "") + (value or "")  # the group is a default
    return f"the config group `{old}` is now `{RENAMED[old]}`: write {new}"


def refuse_renamed_groups(argv: list[str]) -> None:
    """Before Hydra parses `argv`: end the process in one line (once per launch under torchrun) when an override
    names a renamed group, instead of Hydra's "Could not override" error."""
    for override in argv:
        if message := renamed(override):
            console.report_failure(RenamedGroup(message), explained=True)
            console.exit_now(1)
