"""A group's old name is refused in one line naming the new one, before Hydra composes anything; the composed default
config kept in docs/config_reference.yaml is current, with the configs that set each section."""

from __future__ import annotations

import sys

import pytest
from conftest import compose_train, run_bounded, run_environment
from omegaconf import OmegaConf

from colocated_grpo.launch.config_groups import REFERENCE, REGENERATE, reference, renamed
from colocated_grpo.launch.processes import TRAIN_SCRIPT, torchrun_command
from colocated_grpo.provenance import REPO


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


def test_the_config_reference_is_current():
    written = (REPO / REFERENCE).read_text()
    assert written == reference(REPO), f"{REFERENCE} is stale: run `{REGENERATE}` and commit it"


def test_the_config_reference_is_the_composed_default_with_what_sets_each_section():
    text = reference(REPO)
    assert OmegaConf.create(text) == compose_train()  # `python train.py --cfg job`
    assert (
        "# set by: trainer=tiny (conf/trainer/tiny.yaml), placement=colocate (conf/placement/colocate.yaml)\ntrainer:\n"
    ) in text
    assert "# set by: placement=colocate (conf/placement/colocate.yaml)\nplacement:\n" in text
    assert "# set by: conf/train.yaml\nrun:\n" in text
