"""Datasets of yours (hub form, local files, prompt-only), checked before anything loads; prompts measured and fitted
to the length they may have, as the config chooses."""

import json
from pathlib import Path

import pytest
from conftest import compose_train

from colocated_grpo.training import data, models, preflight, prompt_lengths
from colocated_grpo.training.config import ConfigError, validate

POST = "SUBREDDIT: r/AskReddit TITLE: my neighbour keeps borrowing my ladder POST: " + "It happened again today. " * 4


def compose_tiny(*overrides):
    return compose_train("+experiment=tiny_cpu", *overrides)


@pytest.fixture(autouse=True)
def _offline_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOCATED_GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def tldr_dir(tmp_path) -> Path:
    """A dataset directory shaped like trl-lib/tldr: text prompts ending in 'TL;DR:', a reference completion."""
    rows = [{"prompt": f"{POST} ({i})\nTL;DR:", "completion": " lend it less"} for i in range(8)]
    write_jsonl(tmp_path / "tldr" / "train.jsonl", rows)
    return tmp_path / "tldr"


def problems_of(*overrides) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate(compose_tiny(*overrides), 1)
    return err.value.problems


def test_hub_form_reads_a_local_dataset_directory_prompt_only(tldr_dir):
    cfg = compose_tiny("data=hub", f"data.path={tldr_dir}", "reward=length_chars")
    validate(cfg, 1)
    ds = data.build(cfg.data)
    assert set(ds.column_names) == {"prompt", "completion"} and len(ds) == 8  # no answer: prompt-only
    assert ds[0]["prompt"][-1] == {"role": "user", "content": f"{POST} (0)\nTL;DR:"}
    cfg = compose_tiny("data=hub", f"data.path={tldr_dir}", "data.chat_template=false", "data.num_samples=3")
    ds = data.build(cfg.data)
    assert ds[0]["prompt"] == f"{POST} (0)\nTL;DR:" and len(ds) == 3


def test_columns_are_checked_before_loading_all_at_once_with_fixes(tldr_dir):
    found = problems_of(
        "data=hub", f"data.path={tldr_dir}", "data.prompt_column=promt", "data.answer_column=label", "reward=arithmetic"
    )
    assert len(found) == 2, found
    assert found[0].startswith("data.prompt_column='promt' is not a column of data.path=")
    assert found[0].endswith("set data.prompt_column=prompt")
    assert "data.answer_column='label' is not a column" in found[1] and "data.answer_column=null" in found[1]


def test_a_reward_that_needs_an_answer_refuses_a_prompt_only_dataset(tldr_dir):
    found = problems_of("data=hub", f"data.path={tldr_dir}", "reward=arithmetic")
    assert found == [
        "reward.weights.exact_answer: 'exact_answer' needs a reference answer, and data.answer_column is null; set "
        "data.answer_column=<the column holding the answer> or use rewards that need none (e.g. reward=length or "
        "reward=length_chars)"
    ]


def test_hub_dataset_without_path_and_empty_files_are_named(tmp_path):
    assert problems_of("data=hub") == [
        "data.path is not set (???): data=hub needs the dataset: data.path=<hub name, e.g. trl-lib/tldr, or a local "
        "directory or file>"
    ]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert problems_of("data=local", f"data.files={empty}") == [f"data.files='{empty}' is empty: it holds no rows"]
    assert problems_of("data=hub", f"data.path={empty}", "reward=length") == [
        f"data.path='{empty}' is empty: it holds no rows"
    ]
    assert "no such file" in problems_of("data=local", f"data.files={tmp_path}/nope.jsonl")[0]


def test_local_files_of_mixed_formats_are_each_read_by_their_own_extension(tmp_path):
    first = write_jsonl(tmp_path / "first.jsonl", [{"prompt": "What is 1 + 1?", "answer": "2"}])
    (second := tmp_path / "second.csv").write_text("prompt,answer\nWhat is 2 + 2?,4\nWhat is 3 + 3?,6\n")
    third = write_jsonl(tmp_path / "third.json", [{"prompt": "What is 4 + 4?", "answer": "8"}])
    cfg = compose_tiny("data=local", f"data.files=[{first},{second},{third}]")
    validate(cfg, 1)
    ds = data.build(cfg.data)
    assert [(r["prompt"][-1]["content"], r["answer"]) for r in ds] == [
        ("What is 1 + 1?", "2"),
        ("What is 2 + 2?", "4"),
        ("What is 3 + 3?", "6"),
        ("What is 4 + 4?", "8"),
    ]


def test_a_hub_name_validates_without_the_network():
    validate(compose_tiny("data=hub", "data.path=trl-lib/tldr", "reward=length_chars"), 1)


TOKENIZER = None


def tokenizer():
    global TOKENIZER
    TOKENIZER = TOKENIZER or models.build_tokenizer()
    return TOKENIZER


@pytest.mark.parametrize("chat", [False, True])
def test_overlong_prompts_fail_drop_or_truncate_keeping_their_end(chat):
    import datasets

    short, long = "TL;DR:", POST * 3 + "\nTL;DR:"
    prompts = [short, long] if not chat else [[{"role": "user", "content": p}] for p in (short, long)]
    ds = datasets.Dataset.from_list([{"prompt": p} for p in prompts])
    tok = tokenizer()
    lengths = prompt_lengths.measure(ds, tok)["_prompt_tokens"]
    limit = lengths[1] // 2
    by_data = prompt_lengths.prompt_limit(limit, 256, 32, 1024)  # data.max_prompt_tokens: the limit

    kept, report, found = prompt_lengths.fit(ds, tok, *by_data, "fail")
    assert report.overlong == 1 and report.longest_tokens == lengths[1]
    assert f"1 of 2 prompts are longer than {limit} tokens (data.max_prompt_tokens)" in found[0]
    assert "data.overlong_prompts=truncate" in found[0] and found[0].endswith("make room: raise data.max_prompt_tokens")

    kept, report, found = prompt_lengths.fit(ds, tok, *by_data, "drop")
    assert not found and len(kept) == 1 and report.dropped == 1

    kept, report, found = prompt_lengths.fit(ds, tok, *by_data, "truncate")
    assert not found and report.truncated == 1 and len(kept) == 2
    cut = kept[1]["prompt"] if not chat else kept[1]["prompt"][-1]["content"]
    assert cut.endswith("\nTL;DR:") and len(cut) < len(long)
    assert max(prompt_lengths.measure(kept, tok)["_prompt_tokens"]) <= limit


def test_preflight_refuses_long_prompts_naming_keys_and_derives_the_engine_length(tldr_dir, tmp_path):
    base = ("data=hub", f"data.path={tldr_dir}", "data.chat_template=false", "reward=length_chars", "logger=none")
    cfg = compose_tiny(*base, "data.max_prompt_tokens=40")
    with pytest.raises(ConfigError, match=r"data: 8 of 8 prompts are longer than 40 tokens \(data.max_prompt_tokens\)"):
        preflight.prepare(cfg, tmp_path, [])
    cfg = compose_tiny(
        *base, "data.max_prompt_tokens=40", "data.overlong_prompts=truncate", "trainer.vllm_max_model_length=null"
    )
    prepared = preflight.prepare(cfg, tmp_path, [])
    assert prepared.prompts["truncated"] == 8 and prepared.prompts["derived"] == {
        "vllm_max_model_length": 40 + 32,
        "gradient_checkpointing": False,  # the tiny model fits: memory_plan
    }
    assert prepared.args.vllm_max_model_length == 72 and prepared.dataset[0]["prompt"].endswith("TL;DR:")


@pytest.mark.parametrize(
    ("engine", "limit", "room"),
    [
        ("256", "224 tokens (trainer.vllm_max_model_length -", "raise trainer.vllm_max_model_length (at most 1024"),
        ("1024", "992 tokens (trainer.vllm_max_model_length -", "lower"),  # already the model's whole context
        ("null", "992 tokens (the model's max_position_embeddings -", "lower"),  # derived: the context is the limit
    ],
)
def test_the_refusal_of_long_prompts_suggests_raising_the_engine_length_only_below_the_context(
    engine, limit, room, tmp_path
):
    rows = write_jsonl(tmp_path / "long.jsonl", [{"prompt": POST * 40}] * 4)  # over 1024 tokens each
    base = ("data=local", f"data.files={rows}", "data.answer_column=null", "reward=length_chars")
    with pytest.raises(ConfigError) as refused:
        preflight.prepare(compose_tiny(*base, f"trainer.vllm_max_model_length={engine}"), tmp_path, [])
    [problem] = refused.value.problems
    assert f"data: 4 of 4 prompts are longer than {limit} trainer.max_completion_length)" in problem
    assert f"make room: {room}" in problem and problem.endswith("lower trainer.max_completion_length"), problem


def test_dropped_or_cut_prompts_are_said_in_one_line(tmp_path):
    rows = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": POST * (1 + i % 3)} for i in range(12)])
    base = ("data=local", f"data.files={rows}", "data.answer_column=null", "reward=length_chars")
    base += ("trainer.vllm_max_model_length=null",)  # derived from the prompts kept
    prepared = preflight.prepare(compose_tiny(*base), tmp_path, [])
    assert prompt_lengths.said(prepared.prompts) is None, "nothing dropped or cut: nothing said"
    middle = sorted(set(prompt_lengths.measure(prepared.dataset, tokenizer())["_prompt_tokens"]))[1]
    limit = f"data.max_prompt_tokens={middle}"
    prepared = preflight.prepare(compose_tiny(*base, limit, "data.overlong_prompts=drop"), tmp_path, [])
    assert len(prepared.dataset) == 8
    assert prompt_lengths.said(prepared.prompts) == (
        f"data.overlong_prompts=drop: dropped 4 of 12 prompts, longer than {middle} tokens (data.max_prompt_tokens; "
        f"the longest had {prepared.prompts['longest_tokens']})"
    )
    prepared = preflight.prepare(compose_tiny(*base, limit, "data.overlong_prompts=truncate"), tmp_path, [])
    assert prompt_lengths.said(prepared.prompts).startswith(
        f"data.overlong_prompts=truncate: cut the start of 4 of 12 prompts, longer than {middle} tokens"
    )


def test_prompts_that_cannot_be_cut_to_fit_are_refused_before_the_engine_starts(tldr_dir, tmp_path):
    """Truncation cuts the last message's text: a system prompt longer than the limit leaves every prompt too long."""
    base = ("data=hub", f"data.path={tldr_dir}", "reward=length_chars", "logger=none", "data.max_prompt_tokens=40")
    cfg = compose_tiny(*base, "data.overlong_prompts=truncate", f"data.system_prompt='{'Answer briefly. ' * 20}'")
    with pytest.raises(ConfigError) as refused:
        preflight.prepare(cfg, tmp_path, [])
    [problem] = refused.value.problems
    assert problem.startswith("data: 8 of 8 prompts cannot be cut to 40 tokens (data.max_prompt_tokens): what comes")
    assert "row 0 still has" in problem and "data.overlong_prompts=drop, shorten data.system_prompt" in problem
    prepared = preflight.prepare(compose_tiny(*base, "data.overlong_prompts=truncate"), tmp_path, [])
    assert prepared.prompts["truncated"] == 8  # without the system prompt, the same prompts are cut to fit


def test_too_few_rows_for_one_batch_are_refused_before_loading_with_both_numbers(tldr_dir, tmp_path):
    """TRL drops an incomplete generation batch: 3 rows for a step of 4 distinct prompts would train nothing."""
    three = write_jsonl(tmp_path / "three.jsonl", [{"prompt": f"question {i}"} for i in range(3)])
    base = ("data=local", f"data.files={three}", "data.answer_column=null", "reward=length_chars", "logger=none")
    cfg = compose_tiny(*base, "trainer.per_device_train_batch_size=16", "trainer.num_generations=4")
    with pytest.raises(ConfigError) as refused:
        preflight.prepare(cfg, tmp_path, [])
    assert refused.value.problems == [
        "data: the dataset holds 3 prompt(s), but one step needs 4 distinct prompts "
        "(trainer.per_device_train_batch_size=16 x 1 process(es) x steps_per_generation 1 / "
        "trainer.num_generations=4), so no step would train; use a dataset of at least 4 rows or "
        "trainer.per_device_train_batch_size=12 or less"
    ]
    synthetic = compose_tiny("data.num_samples=2", "trainer.per_device_train_batch_size=16", "logger=none")
    with pytest.raises(ConfigError, match=r"holds 2 prompt\(s\).*; use data.num_samples=\d+ or more"):
        preflight.prepare(synthetic, tmp_path, [])
    assert len(preflight.prepare(compose_tiny(*base, "trainer.per_device_train_batch_size=12"), tmp_path, []).dataset)


# The blog's experiment, shrunk to the tiny model and a local tldr-like file: the same config path end to end.

TLDR_ON_TINY = (
    "+experiment=tldr_colocate",
    "model=tiny",
    "data.max_prompt_tokens=48",
    "trainer.max_completion_length=16",
    "trainer.max_steps=2",
    "trainer.bf16=false",
    "trainer.gradient_checkpointing=false",
    "trainer.warmup_steps=0",
    "logger=none",
)


@pytest.fixture(scope="module")
def tldr_file(tmp_path_factory) -> Path:
    rows = [{"prompt": f"{POST * (1 + i % 3)} ({i}) 请总结\nTL;DR:", "completion": " lend it less"} for i in range(12)]
    return write_jsonl(tmp_path_factory.mktemp("tldr") / "train.jsonl", rows)


def test_tldr_experiment_shape_trains_on_the_tiny_model_with_truncated_prompts(train, tldr_file):
    run = train(*TLDR_ON_TINY, f"data.path={tldr_file}")
    record = json.loads((run.dir / "run.json").read_text())
    assert record["status"] == "finished"
    prompts = record["prompts"]
    assert (prompts["rows"], prompts["limit_tokens"], prompts["policy"]) == (12, 48, "truncate")
    assert prompts["truncated"] == prompts["overlong"] > 0
    said = f"data.overlong_prompts=truncate: cut the start of {prompts['truncated']} of 12 prompts, longer than 48 "
    assert run.output.count(said) == 1, "said once, on the console"
    assert prompts["derived"] == {"vllm_max_model_length": 48 + 16}, "unset in the experiment: prompt + completion"
    metrics = run.metrics()
    assert [m["train/global_step"] for m in metrics] == [1, 2]
    assert all(m["rewards/length_chars/mean"] <= 0 for m in metrics)
    sent = [p for r in run.rollouts() for p in r["prompts"]]
    assert sent and all(p.endswith(" 请总结\nTL;DR:") and not p.startswith("<|im_start|>") for p in sent), (
        "plain text, end kept"
    )
    assert "请总结" in (run.dir / "rollouts.jsonl").read_text(encoding="utf-8"), "UTF-8 text: the prompt greps"


def test_overlong_prompts_fail_before_the_engine_loads_naming_the_keys(train, tldr_file):
    run = train(*TLDR_ON_TINY, f"data.path={tldr_file}", "data.overlong_prompts=fail", check=False)
    assert run.proc.returncode != 0
    message = "prompts are longer than 48 tokens (data.max_prompt_tokens)"
    assert message in run.output and "data.overlong_prompts=truncate" in run.output
    assert "nanobind" not in run.output and "maximum context length" not in run.output
    record = json.loads((run.dir / "run.json").read_text())
    assert record["status"] == "failed" and message in record["error"]
    assert not (run.dir / "metrics.jsonl").exists()
