"""A group's old name is refused in one line naming the new one, before Hydra composes anything."""

from __future__ import annotations

import sys

import pytest
from conftest import run_bounded, run_environment

from colocated_grpo.launch.config_groups import renamed
from colocated_grpo.launch.processes import TRAIN_SCRIPT, torchrun_command


def test_an_override_of_the_old_group_name_names_the_new_spelling():
    said = "the config group `vllm` is now `placement`: write "
    assert renamed("vllm=server") == said + "placement=server"
    assert renamed("+vllm=none") == said + "placement=none"  # placement is a default already: no `+`
    assert renamed("vllm@other=colocate") == said + "placement@other=colocate"
    assert renamed("~vllm") == said + "~placement"
    for kept in ("placement=server", "trainer.vllm_mode=server", "placement.fast_sync=false", "-m", "--cfg", "job"):
        assert renamed(kept) is None, kept


@pytest.mark.parametrize(
    "command, times",
    [
        ([sys.executable, str(TRAIN_SCRIPT), "-m", "vllm=colocate,none"], 1),
        (torchrun_command(2, ["vllm=server"]), 2),  # once per launch (not per rank), and in torchrun's summary
    ],
    ids=["multirun", "torchrun"],
)
def test_train_py_refuses_the_old_group_name_in_one_line_before_hydra(command, times, tmp_path):
    proc = run_bounded(command, cwd=tmp_path, env=run_environment(tmp_path / "cache"), timeout=120)
    new = "placement=" + command[-1].split("=")[1]
    line = f"RenamedGroup: the config group `vllm` is now `placement`: write {new}"
    assert proc.returncode == 1
    assert (proc.stdout + proc.stderr).count(line) == times, proc.stderr
    assert "Could not override" not in proc.stderr
    assert not list(tmp_path.iterdir()), "nothing is composed or written before the refusal"
