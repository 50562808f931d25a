import json
import traceback

import pytest

from colocated_grpo.training import rewards
from colocated_grpo.training.rewards import RewardError, boxed_format, exact_answer, for_trl, length, math_accuracy


def test_exact_answer_prefers_last_boxed_and_needs_exact_number():
    completions = [
        "3 + 4 = 7, so \\boxed{7}",
        "first 12 then 7",  # no box: last number counts
        "\\boxed{7} no wait \\boxed{8}",  # last box counts
        "no answer at all",
        "\\boxed{7.0}",  # exact means exact
        "\\boxed{-3}",
    ]
    gold = ["7", "7", "7", "7", "7", "-3"]
    assert exact_answer(completions, answer=gold) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_exact_answer_without_reference_is_none():
    assert exact_answer(["\\boxed{1}"], answer=[None]) == [None]


def test_math_accuracy_uses_math_verify_equivalence():
    completions = [
        "The answer is $\\boxed{\\frac{1}{2}}$",
        "so we get \\boxed{0.5}",
        "\\boxed{72}",
        "I think it is 71 or maybe \\boxed{70}",
        "nothing here",
    ]
    assert math_accuracy(completions, answer=["0.5", "1/2", "72", "72", "72"]) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_math_accuracy_unparsable_reference_is_none():
    assert math_accuracy(["\\boxed{3}"], answer=["not a number"]) == [None]


def test_boxed_format_wants_exactly_one_box():
    assert boxed_format(["\\boxed{1}", "none", "\\boxed{1} \\boxed{2}", "$\\boxed{x+1}$"]) == [1.0, 0.0, 0.0, 1.0]


def test_length_peaks_at_target_tokens():
    ids = [[0] * 16, [0] * 8, [0] * 32, [0] * 40, []]
    assert length([""] * 5, completion_ids=ids, target=16) == [1.0, 0.5, 0.0, 0.0, 0.0]


def test_for_trl_reads_conversational_completions_and_params():
    fn = for_trl("length", {"target": 4})
    assert fn.__name__ == "length"
    out = fn(prompts=[[{"role": "user", "content": "q"}]], completions=[[{"role": "assistant", "content": "abcd"}]])
    assert out == [1.0]


def test_a_reward_that_raises_is_called_once_and_names_the_sample_only_where_that_is_known(monkeypatch):
    calls = []

    def fragile(completions, answer, **_):
        calls.append(list(answer))  # a judge model or a sandbox: every call is one more side effect
        return [float(int(a)) for a in answer]

    monkeypatch.setitem(rewards.REGISTRY, "fragile", fragile)
    fn = for_trl("fragile")
    with pytest.raises(RewardError) as err:
        fn(prompts=["a", "b", "c"], completions=["x", "y", "z"], answer=["1", "oops", "3"])
    assert calls == [["1", "oops", "3"]], "not called again to find the sample"
    assert str(err.value) == (
        "reward 'fragile' raised ValueError: invalid literal for int() with base 10: 'oops' on a batch of 3 samples "
        "(which one is not known without calling the reward again; the samples are listed with this error's "
        "traceback in train.log)"
    )
    assert err.value.__notes__ == [
        f"sample {i}: completion={t!r} columns={{'answer': {a!r}}}"
        for i, t, a in ((0, "x", "1"), (1, "y", "oops"), (2, "z", "3"))
    ]
    assert "sample 1: completion='y' columns={'answer': 'oops'}" in "".join(traceback.format_exception(err.value))
    # a batch of one: its sample is the one
    calls.clear()
    with pytest.raises(RewardError) as err:
        fn(prompts=["b"], completions=["y"], answer=["oops"])
    assert calls == [["oops"]] and str(err.value).endswith(
        "'oops' on sample 0: completion='y' columns={'answer': 'oops'}"
    )


def test_build_keeps_weights_in_order():
    from omegaconf import OmegaConf

    funcs, weights = rewards.build(OmegaConf.create({"weights": {"boxed_format": 0.5, "exact_answer": 2}}))
    assert [f.__name__ for f in funcs] == ["boxed_format", "exact_answer"] and weights == [0.5, 2.0]


def test_length_chars_is_minus_the_distance_to_20_characters():
    assert rewards.length_chars(["x" * 20, "x" * 5, "x" * 26]) == [0.0, -15.0, -6.0]
    assert for_trl("length_chars", {"target": 2})(prompts=["p"], completions=["abc"]) == [-1.0]


def test_unknown_or_mistyped_parameters_name_the_function_and_its_parameters():
    found = rewards.problems({"length": 1.0}, {"length": {"targt": 8}})
    assert found == [
        "reward.params.length.targt: reward 'length' takes no parameter 'targt' (did you mean 'target'?); "
        "its parameters: ['target']"
    ]
    assert rewards.problems({"length": 1.0}, {"length": {"target": "long"}}) == [
        "reward.params.length.target='long' must be an integer"
    ]
    assert "no reward 'length' in reward.weights" in rewards.problems({"boxed_format": 1}, {"length": {"target": 8}})[0]
    assert "must be a number" in rewards.problems({"length": "heavy"}, {})[0]


def test_required_columns_are_parameters_without_default():
    assert rewards.required_columns("exact_answer") == ["answer"]
    assert rewards.required_columns("length") == [] and rewards.parameters("length").keys() == {"target"}


def test_example_reward_module_registers_checked_rewards(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "examples"))
    rewards.load_modules(["my_rewards"])
    assert rewards.REGISTRY["mentions"](["Yes, BECAUSE", "no"], word="because") == [1.0, 0.0]
    assert rewards.REGISTRY["answer_first"](["42 it is", "7"], answer=["42", None]) == [1.0, None]
    assert rewards.required_columns("answer_first") == ["answer"]
    assert rewards.problems({"mentions": 1.0}, {"mentions": {"word": "so"}}) == []
    assert "its parameters: ['word']" in rewards.problems({"mentions": 1.0}, {"mentions": {"wrd": "so"}})[0]


def test_weighted_total_sums_as_trl_leaving_out_scores_that_do_not_apply():
    scores = [[1.0, None, None, 0.0], [0.5, 0.5, None, float("nan")]]
    assert rewards.weighted_total(scores, [2.0, 0.1]) == [2.05, pytest.approx(0.05), None, 0.0]


def test_rollouts_hold_every_rewards_scores_and_their_weighted_total_as_readable_text(tmp_path):
    """The rewards TRL calls, in order, once per generation batch: the last one writes the batch's line, with each
    function's scores and their weighted total per completion, as UTF-8 text (a prompt greps as it was written)."""
    from types import SimpleNamespace

    from colocated_grpo.training.build import recording_rollouts

    funcs = [for_trl("boxed_format"), for_trl("exact_answer"), for_trl("length_chars", {"target": 13})]
    recorded = recording_rollouts(funcs, [0.1, 1.0, 0.5], tmp_path)
    assert [f.__name__ for f in recorded] == ["boxed_format", "exact_answer", "length_chars"]
    prompt = "请计算 3 + 4 的值"
    batch = {
        "prompts": [prompt, prompt],
        "completions": ["答案是 \\boxed{7}", "\\boxed{8}"],
        "answer": ["7", "7"],
        "trainer_state": SimpleNamespace(global_step=4),
    }
    assert [f(**batch) for f in recorded] == [[1.0, 1.0], [1.0, 0.0], [0.0, -4.0]], "each function's own scores"

    text = (tmp_path / "rollouts.jsonl").read_text(encoding="utf-8")
    assert prompt in text and "\\u" not in text
    (line,) = text.splitlines()
    record = json.loads(line)
    assert record["train/global_step"] == 5, "TRL scores a step before counting it"
    assert record["prompts"] == [prompt, prompt] and record["completions"] == batch["completions"]
    assert record["rewards"] == {"boxed_format": [1.0, 1.0], "exact_answer": [1.0, 0.0], "length_chars": [0.0, -4.0]}
    assert record["reward"] == [pytest.approx(0.1 + 1.0), pytest.approx(0.1 - 0.5 * 4)]
