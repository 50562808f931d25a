"""The vLLM importance-sampling ratio from the training forward (compat.trl.OneForward, placement.one_forward) gives
the loss and the sampling/* metrics of TRL's own path, in every importance-sampling mode, with one forward fewer per
generation; off-policy settings keep TRL's path; and every place where our code stands in for TRL's runs TRL's own
code once TRL's source is not the one it was written for."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from colocated_grpo.compat import trl as trl_internals

SCRIPT = Path(__file__).resolve().parent / "scripts" / "is_ratio_paths.py"
EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def both_paths(run_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("is_ratio") / "paths.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], env=run_env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"])
def test_every_importance_sampling_mode_gives_trls_loss_with_one_forward_fewer(both_paths, mode):
    results, steps = both_paths["results"], both_paths["steps_per_generation"]
    trl, ours = results[f"{mode}/trl"], results[f"{mode}/ours"]
    # TRL: one no-grad forward over the generation batch, then one per micro-batch; ours: the micro-batches' only
    assert (trl["generation_forwards"], trl["forwards"]) == (1, 1 + steps)
    assert (ours["generation_forwards"], ours["forwards"]) == (0, steps)
    assert ours["old_logps"] is None, "no old log-probs computed on-policy"

    mask = torch.tensor(trl["mask"]).bool()
    # How far TRL's old log-probs lie from the training forward's: the only input the two paths do not share
    delta = (torch.tensor(trl["old_logps"]) - torch.tensor(ours["train_logps"])).abs()[mask].max().item()
    r_trl, r_ours = torch.tensor(trl["ratio"]), torch.tensor(ours["ratio"])
    assert r_trl.shape == r_ours.shape
    # A sequence ratio sums the differences of up to T tokens; the loss also holds exp(logps - old) (1 on our path)
    terms = mask.shape[1] if mode.startswith("sequence") else 1
    largest = max(r_trl.max().item(), r_ours.max().item())
    ratio_bound = largest * (math.expm1(terms * delta) + 4 * terms * EPS32)
    if mode.endswith("mask"):
        assert torch.equal(r_trl == 0, r_ours == 0), "the same tokens or sequences masked out"
    assert (r_trl - r_ours).abs().max().item() <= ratio_bound

    advantage = max(abs(a) for a in trl["advantages"])
    tokens = int(mask.sum())
    loss_bound = advantage * largest * (math.expm1((terms + 1) * delta) + 4 * tokens * EPS32)
    for ours_loss, trl_loss in zip(ours["losses"], trl["losses"], strict=True):
        assert abs(ours_loss - trl_loss) <= loss_bound, (ours_loss, trl_loss, loss_bound)
    # The bound tells the modes apart: a path that took the ratio of another mode (or none) would fail it
    others = [results[f"{m}/trl"]["losses"] for m in ("sequence_mask", "token_truncate") if m != mode]
    assert any(abs(a - b) > loss_bound for other in others for a, b in zip(other, trl["losses"], strict=True))

    # TRL's sampling/* metrics: one value per generation, the same meaning and value on both paths
    assert set(ours["metrics"]) == set(trl["metrics"]) == set(trl_internals.IS_RATIO_METRICS)
    for name, values in trl["metrics"].items():
        bound = delta if "logp_difference" in name else ratio_bound
        assert len(ours["metrics"][name]) == len(values) == 1
        assert abs(ours["metrics"][name][0] - values[0]) <= bound + 4 * EPS32 * max(1.0, abs(values[0])), name


def _trainer(**args):
    defaults = dict(
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        num_iterations=1,
        gradient_accumulation_steps=4,
        steps_per_generation=2,
        use_liger_kernel=False,
    )
    return SimpleNamespace(args=SimpleNamespace(**{**defaults, **args}))


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ({}, None),
        ({"gradient_accumulation_steps": 2, "steps_per_generation": 2}, None),
        ({"num_iterations": 2}, "trainer.num_iterations=2"),
        ({"gradient_accumulation_steps": 3}, "not a multiple of steps_per_generation=2"),
        ({"gradient_accumulation_steps": 1}, "not a multiple of steps_per_generation=2"),
        ({"use_liger_kernel": True}, "use_liger_kernel"),
        ({"vllm_importance_sampling_correction": False}, "no extra forward to save"),
        ({"use_vllm": False}, "no extra forward to save"),
    ],
)
def test_only_on_policy_training_takes_the_ratio_from_the_training_forward(args, why):
    trainer = _trainer(**args)
    found = trl_internals.one_forward_plan(trainer)
    assert found is None if why is None else why in found
    if why is not None:
        line = trl_internals.install_one_forward(trainer)
        assert line.startswith("importance-sampling ratio: TRL's extra forward (") and why in line
        assert not hasattr(trainer, "_compute_loss"), "nothing installed"


def test_the_ratio_of_each_mode():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    sampling = torch.tensor([[-1.5, -2.0, float("nan")], [-0.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token = torch.tensor([[math.exp(0.5), 1.0, 1.0], [math.exp(-0.5), 1.0, 1.0]])  # NaN and padding: no difference
    ratio = trl_internals.vllm_is_ratio
    assert torch.allclose(ratio(logps, sampling, mask, "token_truncate", None, 1.5), token.clamp(max=1.5))
    outside = (token < 0.7) | (token > 1.5)
    assert torch.allclose(ratio(logps, sampling, mask, "token_mask", 0.7, 1.5), token.masked_fill(outside, 0.0))
    sequence = torch.tensor([[math.exp(0.5)], [math.exp(-0.5)]])
    assert torch.allclose(ratio(logps, sampling, mask, "sequence_truncate", 0.7, None), sequence.clamp(min=0.7))
    assert torch.allclose(ratio(logps, sampling, mask, "sequence_mask", 0.7, 3.0), torch.tensor([[math.exp(0.5)], [0]]))
    with pytest.raises(ValueError, match="unknown vllm_importance_sampling_mode"):
        ratio(logps, sampling, mask, "tokens", None, None)


# ----------------------------------------------------------------------------------------------- the upstream guard


def test_each_replacement_was_written_for_the_installed_trl():
    """CI installs trl 1.16.0: every replacement must take effect there, or its speed would silently be lost."""
    for replacement in trl_internals.WRITTEN_FOR:
        assert trl_internals.upstream_mismatch(replacement) is None, replacement


@pytest.fixture
def changed_reference(monkeypatch):
    """WRITTEN_FOR as if each replacement had been written for a TRL whose first function read differently."""

    def change(replacement: str) -> str:
        targets = dict(trl_internals.WRITTEN_FOR[replacement])
        first = next(iter(targets))
        targets[first] = "000000000000"
        monkeypatch.setitem(trl_internals.WRITTEN_FOR, replacement, targets)
        return first.partition(":")[2]

    return change


def test_a_changed_log_prob_parser_keeps_trls_own(changed_reference):
    import trl.generation.vllm_generation as vllm_generation

    name = changed_reference("flat log-prob reader")
    before = vllm_generation.extract_logprobs
    line = trl_internals.install_flat_logprob_reader()
    assert line.startswith("flat log-prob reader: TRL's own code runs: written for trl 1.16.0") and name in line
    assert vllm_generation.extract_logprobs is before


def test_a_changed_weight_sync_keeps_trls_own(changed_reference):
    from accelerate.utils import DistributedType  # noqa: F401 - the plan reads accelerate's PEFT check

    name = changed_reference("batched weight sync")
    model = torch.nn.Linear(2, 2)
    generation = SimpleNamespace(
        mode="colocate", _iter_named_params=None, _dist=SimpleNamespace(is_zero3=False, fsdp_version=None), model=model
    )
    sync = generation.sync_weights = object()
    line = trl_internals.install_fast_sync(SimpleNamespace(vllm_generation=generation), 2**30)
    assert line.startswith("weight sync: batched weight sync: TRL's own code runs") and name in line
    assert generation.sync_weights is sync


def test_a_changed_trainer_keeps_trls_extra_forward(changed_reference):
    name = changed_reference("importance-sampling ratio from the training forward")
    trainer = _trainer()
    line = trl_internals.install_one_forward(trainer)
    assert "TRL's own code runs: written for trl 1.16.0" in line and name in line
    assert not hasattr(trainer, "_compute_loss"), "nothing installed"
