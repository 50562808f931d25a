"""bench/micro_batches.py: one optimizer step of our trainer (TRL's compute_loss and the backward of each micro-batch)
in TRL's, balanced and packed micro-batches, on CPU: every variant computes the same loss; by the trainer's own counts
balanced computes less padding than TRL's, and packed none, every forward packed."""

import json

from colocated_grpo.bench import micro_batches


def test_each_variant_trains_the_same_tokens_with_its_own_padding(tmp_path, capsys):
    out = tmp_path / "micro.json"
    micro_batches.main(
        ["--device", "cpu", "--rows", "16", "--micro-batches", "4", "--cap", "64", "--repeats", "1", "--json", str(out)]
    )
    printed = capsys.readouterr().out
    variants = json.loads(out.read_text())["variants"]
    assert list(variants) == list(micro_batches.VARIANTS)
    assert all(f"  {name} " in printed for name in variants)
    losses = [v["loss"] for v in variants.values()]
    assert max(losses) - min(losses) < 1e-5 * max(1.0, abs(losses[0])), losses
    assert variants["balanced"]["padding_share"] < variants["trl"]["padding_share"]
    assert variants["packed"]["padding_share"] == variants["packed_balanced"]["padding_share"] == 0.0
    assert [v["packed_share"] for v in variants.values()] == [0.0, 0.0, 1.0, 1.0]
    assert all(len(v["seconds"]) == 1 and v["median_s"] > 0 for v in variants.values())
