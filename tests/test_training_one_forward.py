"""The vLLM importance-sampling ratio from the training forward (training.trainer.ColocatedGRPOTrainer,
placement.one_forward) gives the loss and the sampling/* metrics of TRL's own path, in every importance-sampling mode,
with one forward fewer per generation and TRL's buffered micro-batches left as TRL made them; off-policy settings keep
TRL's path; no method of the built trainer is replaced on the instance; and every place where our code stands in for
TRL's runs TRL's own code, with a WARNING, once TRL's source (or a subclass of ours) is not the one it was written
for."""

import json
import logging
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from colocated_grpo.compat import grpo_trainer as guard
from colocated_grpo.compat import trl as trl_internals
from colocated_grpo.training import trainer as grpo

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
    assert set(ours["metrics"]) == set(trl["metrics"]) == set(grpo.IS_RATIO_METRICS)
    for name, values in trl["metrics"].items():
        bound = delta if "logp_difference" in name else ratio_bound
        assert len(ours["metrics"][name]) == len(values) == 1
        assert abs(ours["metrics"][name][0] - values[0]) <= bound + 4 * EPS32 * max(1.0, abs(values[0])), name


def test_no_method_of_the_built_trainer_is_replaced_on_the_instance(both_paths):
    """The real trainer, its callbacks added (telemetry and the profiler too): TRL's methods are overridden in our
    classes, none is shadowed by an instance attribute, on the trainer or on its engine wrapper."""
    assert both_paths["replaced"] == {"ColocatedGRPOTrainer": [], "ColocatedVLLMGeneration": []}


def _args(**args):
    defaults = dict(
        use_vllm=True,
        vllm_mode="server",  # no engine here to reseed
        vllm_importance_sampling_correction=True,
        num_iterations=1,
        gradient_accumulation_steps=4,
        steps_per_generation=2,
        use_liger_kernel=False,
        liger_kernel_config=None,
        seed=0,
        generation_kwargs={},
    )
    return SimpleNamespace(**{**defaults, **args})


@pytest.fixture
def build(monkeypatch):
    """Our trainer over a stand-in for TRL's __init__ (no model, no engine): its decisions and its overrides alone."""
    from trl import GRPOTrainer

    def init(self, *, args, generation=None):
        self.args = args
        if generation is not None:
            self.vllm_generation = generation

    monkeypatch.setattr(GRPOTrainer, "__init__", init)

    def build(cls=grpo.ColocatedGRPOTrainer, generation=None, flat_logprobs=None, **args):
        sync = 2**30 if generation is not None else None
        kwargs = dict(seed=0, flat_logprobs=flat_logprobs, sync_chunk_bytes=sync, one_forward=True)
        return cls(args=_args(**args), generation=generation, **kwargs)

    return build


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ({}, None),
        ({"gradient_accumulation_steps": 2, "steps_per_generation": 2}, None),
        ({"num_iterations": 2}, "trainer.num_iterations=2"),
        ({"gradient_accumulation_steps": 3}, "not a multiple of steps_per_generation=2"),
        ({"gradient_accumulation_steps": 1}, "not a multiple of steps_per_generation=2"),
        ({"use_liger_kernel": True}, None),  # TRL keeps its log-prob forward: Liger's layer kernels only
        ({"use_liger_kernel": True, "liger_kernel_config": {"fused_linear_cross_entropy": True}}, "fused linear"),
        ({"vllm_importance_sampling_correction": False}, "no extra forward to save"),
        ({"use_vllm": False}, "no extra forward to save"),
    ],
)
def test_only_on_policy_training_takes_the_ratio_from_the_training_forward(build, caplog, args, why):
    with caplog.at_level(logging.INFO, logger=grpo.__name__):
        trainer = build(**args)
    [record] = caplog.records
    assert trainer.one_forward is (why is None)
    if why is None:
        assert record.getMessage().startswith("importance-sampling ratio: from the training forward")
    else:
        assert record.getMessage().startswith("importance-sampling ratio: TRL's extra forward (")
        assert why in record.getMessage() and record.levelno == logging.INFO


def test_the_ratio_of_each_mode():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    sampling = torch.tensor([[-1.5, -2.0, float("nan")], [-0.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    token = torch.tensor([[math.exp(0.5), 1.0, 1.0], [math.exp(-0.5), 1.0, 1.0]])  # NaN and padding: no difference
    ratio = grpo.vllm_is_ratio
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
    for replacement in guard.WRITTEN_FOR:
        assert guard.upstream_mismatch(replacement) is None, replacement
    assert guard.upstream_mismatch("batched weight sync", grpo.ColocatedVLLMGeneration) is None
    assert (
        guard.upstream_mismatch("importance-sampling ratio from the training forward", grpo.ColocatedGRPOTrainer)
        is None
    )


@pytest.fixture
def changed_reference(monkeypatch):
    """WRITTEN_FOR as if each replacement had been written for a TRL whose first function read differently."""

    def change(replacement: str) -> str:
        targets = dict(guard.WRITTEN_FOR[replacement])
        first = next(iter(targets))
        targets[first] = "000000000000"
        monkeypatch.setitem(guard.WRITTEN_FOR, replacement, targets)
        return first.partition(":")[2]

    return change


def _warning(caplog, *parts):
    [record] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert record.levelno == logging.WARNING
    for part in parts:
        assert part in record.getMessage(), (part, record.getMessage())


def test_the_flat_reader_stands_in_for_trls_parser_only_inside_our_generate(build, monkeypatch):
    """TRL's generate calls its module's extract_logprobs by name: during our wrapper's generate that name is our
    reader (TRL's own parser its fallback); before and after, and for any other code, it is TRL's own."""
    import trl.generation.vllm_generation as vllm_generation

    original = vllm_generation.extract_logprobs
    trainer = build(generation=_generation(), generation_kwargs={"flat_logprobs": True})
    assert trainer.vllm_generation.flat_logprobs and vllm_generation.extract_logprobs is original
    seen = []

    def trls_generate(self, *args, **kwargs):  # what TRL's generate reads, by name, after the engine's call
        seen.append(vllm_generation.extract_logprobs)
        return vllm_generation.extract_logprobs([])

    monkeypatch.setattr(vllm_generation.VLLMGeneration, "generate", trls_generate)
    reads = []
    monkeypatch.setattr(trl_internals, "read_flat_logprobs", lambda outputs, fallback: reads.append(fallback))
    trainer.vllm_generation.generate()
    assert seen[0] is not original and reads == [original]
    assert vllm_generation.extract_logprobs is original
    without = build(generation=_generation())  # no flat log-probs asked for: TRL's parser inside generate too
    assert not without.vllm_generation.flat_logprobs
    without.vllm_generation.generate()
    assert seen[1] is original and len(reads) == 1


@pytest.mark.parametrize("target", list(guard.WRITTEN_FOR["flat log-prob reader"]))
def test_a_changed_parser_or_generate_keeps_trls_own_parser(build, monkeypatch, caplog, target):
    import trl.generation.vllm_generation as vllm_generation

    original = vllm_generation.extract_logprobs
    monkeypatch.setitem(guard.WRITTEN_FOR, "flat log-prob reader", {target: "000000000000"})
    trainer = build(generation=_generation(), flat_logprobs=True)
    name = target.partition(":")[2]
    _warning(caplog, "flat log-prob reader: TRL's own code runs: written for trl 1.16.0", name, "slower generation")
    assert not trainer.vllm_generation.flat_logprobs
    assert vllm_generation.extract_logprobs is original


def test_a_changed_generate_of_trls_trainer_counts_no_tokens(build, changed_reference, caplog, monkeypatch):
    """Our token counts read TRL's _generate's return order: a changed _generate is not read (tokens/s reads 0)."""
    from trl import GRPOTrainer

    from colocated_grpo.telemetry.phases import TokenCounter

    counted = build()
    name = changed_reference("token counts")
    trainer = build()
    _warning(caplog, "token counts: TRL's own code runs", name, "perf/tokens_per_s")
    monkeypatch.setattr(GRPOTrainer, "_generate", lambda self: ([[1, 2]], [[3, 4, 5]]))
    for built in (counted, trainer):
        built.token_counter = TokenCounter()
        built._generate()
    assert counted.token_counter.reset() == (2, 3) and trainer.token_counter.reset() == (0, 0)


def test_our_trainer_is_a_drop_in_grpo_trainer(build, monkeypatch):
    """Built with TRL's arguments alone: the engine seed from args.seed, the flat reader where the request asks for
    flat log-probs, the batched sync and the one-forward ratio on."""
    seeds = []
    monkeypatch.setattr(grpo.ColocatedGRPOTrainer, "_reseed_generation", lambda self, seed: seeds.append(seed))
    args = _args(seed=7, generation_kwargs={"flat_logprobs": True})
    trainer = grpo.ColocatedGRPOTrainer(args=args, generation=_generation())
    assert seeds == [7] and trainer.one_forward
    assert trainer.vllm_generation.flat_logprobs and trainer.vllm_generation.batched_sync


def test_the_importance_sampling_flag_is_restored_to_its_value(build, monkeypatch):
    from trl import GRPOTrainer

    trainer, seen = build(), []
    assert trainer.one_forward
    monkeypatch.setattr(
        GRPOTrainer,
        "_generate_and_score_completions",
        lambda self: seen.append(self.vllm_importance_sampling_correction),
    )
    trainer.model = SimpleNamespace(training=True)
    for value in (True, False):
        trainer.vllm_importance_sampling_correction = value
        trainer._generate_and_score_completions()
        assert trainer.vllm_importance_sampling_correction == value
    assert seen == [False, False]


def _generation():
    """TRL's engine wrapper, as its __init__ leaves it for one DDP process, without an engine."""
    from trl.generation.vllm_generation import VLLMGeneration

    generation = VLLMGeneration.__new__(VLLMGeneration)
    generation.mode, generation.model = "colocate", torch.nn.Linear(2, 2)
    generation._dist = SimpleNamespace(is_zero3=False, fsdp_version=None)
    return generation


def test_a_changed_weight_sync_warns_and_runs_trls_own(build, changed_reference, caplog, monkeypatch):
    from trl.generation.vllm_generation import VLLMGeneration

    name = changed_reference("batched weight sync")
    trainer = build(generation=_generation())
    _warning(caplog, "weight sync: batched weight sync: TRL's own code runs", name, "0.27 s instead of 0.02 s")
    sync_calls = []
    monkeypatch.setattr(VLLMGeneration, "sync_weights", lambda self: sync_calls.append("TRL's"))
    assert type(trainer.vllm_generation) is grpo.ColocatedVLLMGeneration
    trainer.vllm_generation.sync_weights()
    assert sync_calls == ["TRL's"]


class _OwnLoss(grpo.ColocatedGRPOTrainer):
    """A user's subclass of ours that overrides a method our ratio relies on."""

    def _compute_loss(self, model, inputs):
        return super()._compute_loss(model, inputs)


def _micro_batch():
    return {
        "sampling_per_token_logps": torch.tensor([[-1.0, -2.0]]),
        "completion_mask": torch.tensor([[1.0, 1.0]]),
    }


def _run_a_micro_batch(trainer, monkeypatch) -> tuple[list, dict]:
    """One generation and one micro-batch's loss through `trainer`, over stand-ins for TRL's methods that record what
    TRL's own code would see: the correction flag at generation, the micro-batch dict at the loss."""
    from trl import GRPOTrainer

    seen, batch = [], _micro_batch()

    def forward(self, model, *args, **kwargs):
        return torch.tensor([[-1.5, -2.0]]), None, None

    def loss(self, model, inputs):
        seen.append(inputs)
        self._get_per_token_logps_and_entropies(model)
        return inputs.get("importance_sampling_ratio")

    monkeypatch.setattr(
        GRPOTrainer,
        "_generate_and_score_completions",
        lambda self, b: seen.append(self.vllm_importance_sampling_correction),
    )
    monkeypatch.setattr(GRPOTrainer, "_compute_loss", loss)
    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", forward)
    trainer.model = SimpleNamespace(training=True)
    trainer.vllm_importance_sampling_correction = True
    trainer.vllm_importance_sampling_mode, trainer.vllm_importance_sampling_clip_min = "token_truncate", None
    trainer.vllm_importance_sampling_clip_max = 3.0
    trainer._generate_and_score_completions({})
    trainer._compute_loss(None, batch)
    return seen, batch


def test_our_ratio_goes_into_a_copy_of_trls_micro_batch(build, monkeypatch):
    seen, batch = _run_a_micro_batch(build(), monkeypatch)
    assert seen[0] is False, "TRL generated with the correction off: no extra forward"
    assert seen[1] is not batch and "importance_sampling_ratio" in seen[1]
    assert torch.allclose(seen[1]["importance_sampling_ratio"], torch.tensor([[math.exp(-0.5), 1.0]]))
    assert set(batch) == set(_micro_batch()), "TRL's buffered micro-batch is left as TRL made it"


@pytest.mark.parametrize("how", ["TRL changed", "a subclass of ours"])
def test_a_changed_trainer_warns_and_runs_trls_extra_forward(build, changed_reference, caplog, monkeypatch, how):
    if how == "TRL changed":
        name = changed_reference("importance-sampling ratio from the training forward")
        trainer = build()
    else:
        trainer, name = build(_OwnLoss), "_OwnLoss._compute_loss"
    _warning(caplog, "TRL's own code runs: written for trl 1.16.0", name, "TRL's extra no-grad forward")
    assert not trainer.one_forward
    seen, batch = _run_a_micro_batch(trainer, monkeypatch)
    assert seen[0] is True and seen[1] is batch, "TRL's own path: the correction on, TRL's micro-batch as is"
    assert "importance_sampling_ratio" not in batch


def test_a_trl_that_moved_its_engine_wrapper_runs_its_own_code_with_a_warning(monkeypatch):
    """trl.generation missing: our module still imports, and each change that relies on it says TRL's own code runs."""
    import importlib

    for moved_away in ("trl.generation", "trl.generation.vllm_generation"):
        monkeypatch.setitem(sys.modules, moved_away, None)  # importing it raises ImportError
    monkeypatch.delitem(sys.modules, guard.__name__)
    moved = importlib.import_module(guard.__name__)
    assert moved is not guard and moved.vllm_generation is None
    for change in ("flat log-prob reader", "batched weight sync"):
        assert moved.upstream_mismatch(change).startswith(f"{change}: TRL's own code runs"), change
    assert moved.upstream_mismatch("token counts") is None  # GRPOTrainer's own _generate is where it was
