"""Micro-batches balanced by tokens (training/micro_batches.py, run.balance_micro_batches): each optimizer step keeps
its rows and each micro-batch its row count; padded, rows of similar lengths go together and each micro-batch is cut to
its own longest row, with the same log-probs and loss gradients as TRL's micro-batches; packed, the micro-batches
hold about the same number of tokens."""

from types import SimpleNamespace

import pytest
import torch
from test_training_packing import tiny_model

from colocated_grpo.training import micro_batches

PROMPT, COMPLETION = 6, 12  # the generation batch's longest prompt and completion: every TRL micro-batch's widths
PER_STEP, STEPS, ROWS = 3, 2, 4  # micro-batches per optimizer step, optimizer steps per generation, rows each


@pytest.fixture(scope="module")
def buffer():
    """TRL's buffer of one generation batch: micro-batches of shuffled rows, prompts padded on the left and
    completions on the right to the widths of the whole generation batch."""
    generator = torch.Generator().manual_seed(0)
    micro = []
    for _ in range(PER_STEP * STEPS):
        prompt_lengths = torch.randint(1, PROMPT + 1, (ROWS,), generator=generator)
        completion_lengths = torch.randint(1, COMPLETION + 1, (ROWS,), generator=generator)
        prompt_mask = (torch.arange(PROMPT) >= PROMPT - prompt_lengths[:, None]).long()
        completion_mask = (torch.arange(COMPLETION) < completion_lengths[:, None]).long()
        micro.append(
            {
                "prompt_ids": torch.randint(1, 300, (ROWS, PROMPT), generator=generator) * prompt_mask,
                "prompt_mask": prompt_mask,
                "completion_ids": torch.randint(1, 300, (ROWS, COMPLETION), generator=generator) * completion_mask,
                "completion_mask": completion_mask,
                "advantages": torch.randn(ROWS, generator=generator),  # tells the rows apart
                "old_per_token_logps": -torch.rand(ROWS, COMPLETION, generator=generator) * completion_mask,
                "importance_sampling_ratio": torch.rand(ROWS, 1, generator=generator),  # sequence level: (rows, 1)
                "num_items_in_batch": torch.tensor(0),
            }
        )
    # the longest prompt and completion of the generation batch in its last micro-batch: TRL's widths are theirs
    micro[-1]["prompt_mask"][0], micro[-1]["completion_mask"][0] = 1, 1
    for batch in micro:
        batch["num_items_in_batch"] = sum(int(b["completion_mask"].sum()) for b in micro)
    return micro


def _rows(batch: dict) -> dict[float, tuple]:
    """Each row by its advantage: its tokens and its per-token values where they are not padding."""
    rows = {}
    for i, advantage in enumerate(batch["advantages"].tolist()):
        prompt, completion = batch["prompt_mask"][i].bool(), batch["completion_mask"][i].bool()
        rows[advantage] = (
            batch["prompt_ids"][i][prompt].tolist(),
            batch["completion_ids"][i][completion].tolist(),
            batch["old_per_token_logps"][i][completion].tolist(),
            batch["importance_sampling_ratio"][i].tolist(),
        )
    return rows


def _step_rows(micro: list[dict], step: int) -> dict[float, tuple]:
    return {k: v for batch in micro[step * PER_STEP : (step + 1) * PER_STEP] for k, v in _rows(batch).items()}


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_each_optimizer_step_keeps_its_rows_in_micro_batches_of_equal_counts(buffer, packed):
    regrouped = micro_batches.regroup(buffer, PER_STEP, packed)
    assert len(regrouped) == len(buffer)
    assert all(len(batch["advantages"]) == ROWS for batch in regrouped)
    for step in range(STEPS):
        assert _step_rows(regrouped, step) == _step_rows(buffer, step), "the same rows, tokens and values"
    assert all(batch["num_items_in_batch"] == buffer[0]["num_items_in_batch"] for batch in regrouped)


def test_padded_micro_batches_hold_similar_lengths_each_cut_to_its_longest(buffer):
    regrouped = micro_batches.regroup(buffer, PER_STEP, packed=False)
    for batch in regrouped:
        assert batch["prompt_mask"][:, 0].any() and batch["completion_mask"][:, -1].any(), "no column all padding"
        assert batch["old_per_token_logps"].shape == batch["completion_ids"].shape
        assert batch["importance_sampling_ratio"].shape == (ROWS, 1)
    before, after = (_padding_share(micro) for micro in (buffer, regrouped))
    print(f"padding share: TRL's micro-batches {before:.3f}, regrouped {after:.3f}")
    assert after < 0.7 * before


def _padding_share(micro: list[dict]) -> float:
    """The share of the tokens padded forwards over these micro-batches compute that are padding."""
    real = sum(int(micro_batches.lengths(batch).sum()) for batch in micro)
    computed = sum(batch["prompt_ids"].numel() + batch["completion_ids"].numel() for batch in micro)
    return 1.0 - real / computed


def test_packed_micro_batches_hold_about_equal_tokens(buffer):
    for step in range(STEPS):
        window = slice(step * PER_STEP, (step + 1) * PER_STEP)
        tokens = [
            [int(micro_batches.lengths(batch).sum()) for batch in micro[window]]
            for micro in (buffer, micro_batches.regroup(buffer, PER_STEP, packed=True))
        ]
        longest_row = max(int(micro_batches.lengths(batch).max()) for batch in buffer[window])
        assert max(tokens[1]) - min(tokens[1]) <= longest_row, tokens
        assert max(tokens[1]) - min(tokens[1]) <= max(tokens[0]) - min(tokens[0]), tokens


def test_balancing_greedily_fills_the_micro_batch_with_the_fewest_tokens():
    assert micro_batches.groups([9, 1, 5, 5, 8, 2], 2, packed=True) == [[0, 3, 1], [4, 2, 5]]  # 15 and 15 tokens
    assert micro_batches.groups([9, 1, 5, 5, 8, 2], 2, packed=False) == [[0, 4, 2], [3, 5, 1]]


def test_regrouped_micro_batches_give_trl_s_log_probs_and_gradient(buffer):
    """The padded forward of each micro-batch (TRL's: prompt and completion concatenated, no position ids), the
    dapo loss summed over an optimizer step: the same per-row log-probs and gradients after regrouping."""
    model = tiny_model()

    def step(micro):
        model.zero_grad()
        logps = {}
        for batch in micro[:PER_STEP]:
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            width = batch["completion_ids"].size(1)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1 : -1]
            per_token = logits.log_softmax(-1).gather(-1, batch["completion_ids"][..., None])[..., 0]
            completion = batch["completion_mask"]
            loss = -(per_token * completion * batch["advantages"][:, None]).sum() / batch["num_items_in_batch"]
            loss.backward()
            for i, advantage in enumerate(batch["advantages"].tolist()):
                logps[advantage] = per_token[i][completion[i].bool()].detach()
        return logps, [p.grad.clone() for p in model.parameters()]

    (trl_logps, trl_grads), (our_logps, our_grads) = step(buffer), step(micro_batches.regroup(buffer, PER_STEP, False))
    assert trl_logps.keys() == our_logps.keys()
    assert max((trl_logps[row] - our_logps[row]).abs().max().item() for row in trl_logps) < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(trl_grads, our_grads, strict=True)) < 1e-6


def test_what_balancing_refuses_and_what_it_leaves_to_trl(buffer):
    def why_not(**changes):
        from trl import GRPOConfig

        defaults = {name: getattr(GRPOConfig, name) for name in ("entropy_coef", "use_adaptive_entropy")}
        args = {"loss_type": "dapo", "top_entropy_quantile": 1.0, "steps_per_generation": 4}
        return micro_batches.why_not(
            SimpleNamespace(**{**defaults, **args, "gradient_accumulation_steps": 2, **changes})
        )

    assert "each micro-batch's tokens" in why_not(loss_type="bnpo")
    assert "entropies" in why_not(top_entropy_quantile=0.2)
    assert "no multiple" in why_not(steps_per_generation=3)
    assert "entropy bonus" in why_not(entropy_coef=0.01)
    assert "entropy bonus" in why_not(use_adaptive_entropy=True)
    assert all(why_not(loss_type=loss) is None for loss in ("dapo", "grpo", "dr_grpo", "cispo", "sapo"))
    with_images = [{**batch, "pixel_values": torch.zeros(ROWS, 3)} for batch in buffer]
    assert micro_batches.regroup(with_images, PER_STEP, packed=False) is None, "images: TRL's micro-batches stay"
