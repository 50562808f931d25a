"""What a run that ran out of memory is told, and what its resume accepts: gradient checkpointing changes no math, so a
resume may turn it on (or off, or hand the choice to run.auto_memory); the out-of-memory message names the value in
force and what decided it, and offers checkpointing first where it was off, never where it was on."""

from __future__ import annotations

import pytest
from conftest import compose_train
from omegaconf import OmegaConf
from test_resilience import _oom_in

from colocated_grpo.resilience import checkpoints, out_of_memory


def _run(*overrides):
    return compose_train("run.name=r", *overrides)  # a name of its own: Hydra's run config is not set here


@pytest.fixture
def started(tmp_path):
    """A run directory whose config.yaml is the default config, as its first attempt wrote it (auto_memory chose)."""
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(_run(), resolve=True))
    return tmp_path


@pytest.mark.parametrize(
    "overrides",
    [
        ["trainer.gradient_checkpointing=true"],
        ["trainer.gradient_checkpointing=false"],
        ["run.auto_memory=false"],
        ["trainer.gradient_checkpointing=true", "run.auto_memory=false"],
    ],
)
def test_a_resume_accepts_another_gradient_checkpointing(started, overrides):
    checkpoints.check_config(_run(*overrides), started, previous={})  # no ResumeError


def test_a_resume_still_refuses_a_change_of_the_math_beside_it(started):
    cfg = _run("trainer.gradient_checkpointing=true", "trainer.learning_rate=0.5")
    with pytest.raises(checkpoints.ResumeError) as refused:
        checkpoints.check_config(cfg, started, previous={})
    changed = str(refused.value).split("\n  ", 1)[1].split("\nTo continue")[0]
    assert changed == "trainer.learning_rate: 1e-05 -> 0.5", "only the learning rate is a change of the experiment"


def _training_oom(*overrides, checkpointing: bool | None) -> str:
    cfg = compose_train("placement=colocate", *overrides)
    return str(out_of_memory.explain(_oom_in("backward"), cfg, 4, checkpointing=checkpointing))


def _remedies(message: str) -> list[str]:
    return message.split("to leave more room for training: ", 1)[1].rstrip(".").split("; ")


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_checkpointing_off_as_auto_memory_chose_is_named_and_offered_first():
    message = _training_oom(checkpointing=False)
    assert "trainer.per_device_train_batch_size=4, gradient checkpointing off (chosen by run.auto_memory); " in message
    assert _remedies(message)[0] == "trainer.gradient_checkpointing=true (a resume of this run accepts it)"


def test_checkpointing_on_is_named_and_never_offered():
    for overrides, by in (([], "chosen by run.auto_memory"), (["trainer.gradient_checkpointing=true"], "given")):
        message = _training_oom(*overrides, checkpointing=True)
        assert f"gradient checkpointing on ({by}); " in message
        assert not any("gradient_checkpointing" in remedy for remedy in _remedies(message)), message
        assert _remedies(message)[0].startswith("placement=colocate_sleep"), "the first remedy is one that applies"


def test_the_value_in_force_is_the_given_one_or_trls_default():
    given_off = _training_oom("trainer.gradient_checkpointing=false", checkpointing=None)
    assert "gradient checkpointing off (given); " in given_off
    assert _remedies(given_off)[0] == "trainer.gradient_checkpointing=true (a resume of this run accepts it)"
    trl_default = _training_oom("run.auto_memory=false", checkpointing=True)
    assert "gradient checkpointing on (TRL's default); " in trl_default
