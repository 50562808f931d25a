"""Prompt datasets: synthetic arithmetic (offline), GSM8K (hub) and local files, all as conversational prompts
with an `answer` column that the rewards read."""

from __future__ import annotations

import random
from collections.abc import Iterator

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def arithmetic_problems(num_samples: int, max_operand: int, operations, seed: int) -> list[dict]:
    """Deterministic two-operand problems: [{"question": "37 + 5", "answer": "42"}, ...]."""
    unknown = set(operations) - set(OPERATIONS)
    if unknown:
        raise ValueError(f"data.operations has unknown {sorted(unknown)}; choose from {sorted(OPERATIONS)}")
    rng = random.Random(seed)
    problems = []
    for _ in range(num_samples):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(list(operations))
        problems.append({"question": f"{a} {op} {b}", "answer": str(OPERATIONS[op](a, b))})
    return problems


def arithmetic_corpus() -> Iterator[str]:
    """Text the offline tokenizer is trained on: chat-formatted arithmetic problems and worked answers."""
    for p in arithmetic_problems(3000, 99, list(OPERATIONS), seed=1234):
        yield f"<|im_start|>user\nWhat is {p['question']}?<|im_end|>\n<|im_start|>assistant\n"
        yield f"{p['question']} = {p['answer']}, so the answer is \\boxed{{{p['answer']}}}.<|im_end|>"


def _conversation(question: str, system_prompt: str | None) -> list[dict]:
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": question}]


def build(data_cfg):
    """Return a `datasets.Dataset` with `prompt` (list of chat messages) and `answer` columns."""
    import datasets

    source = data_cfg.source
    system_prompt = data_cfg.get("system_prompt")
    if source == "arithmetic":
        rows = arithmetic_problems(data_cfg.num_samples, data_cfg.max_operand, data_cfg.operations, data_cfg.seed)
        return datasets.Dataset.from_list(
            [{"prompt": _conversation(f"What is {r['question']}?", system_prompt), "answer": r["answer"]} for r in rows]
        )
    if source == "gsm8k":
        ds = datasets.load_dataset(data_cfg.path, data_cfg.name, split=data_cfg.split)
        ds = ds.map(
            lambda r: {
                "prompt": _conversation(r["question"], system_prompt),
                "answer": r["answer"].split("####")[-1].strip().replace(",", ""),
            },
            remove_columns=ds.column_names,
        )
        return _limit(ds, data_cfg.get("num_samples"))
    if source == "local":
        ds = _load_local(data_cfg.files)
        for key in ("prompt_column", "answer_column"):
            if data_cfg[key] not in ds.column_names:
                raise ValueError(f"data.{key}={data_cfg[key]!r} is not a column of {data_cfg.files}: {ds.column_names}")
        prompt_col, answer_col = data_cfg.prompt_column, data_cfg.answer_column
        ds = ds.map(
            lambda r: {
                "prompt": r[prompt_col]
                if isinstance(r[prompt_col], list)
                else _conversation(r[prompt_col], system_prompt),
                "answer": str(r[answer_col]),
            },
            remove_columns=ds.column_names,
        )
        return _limit(ds, data_cfg.get("num_samples"))
    raise ValueError(f"data.source={source!r} is unknown; choose arithmetic, gsm8k or local")


def _load_local(files):
    import datasets

    files = [files] if isinstance(files, str) else list(files)
    suffix = files[0].rsplit(".", 1)[-1].lower()
    builder = {"json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv"}.get(suffix)
    if builder is None:
        raise ValueError(f"data.files: cannot read '.{suffix}' files; use json, jsonl, parquet or csv")
    return datasets.load_dataset(builder, data_files=files, split="train")


def _limit(ds, num_samples):
    return ds.select(range(min(num_samples, len(ds)))) if num_samples else ds
