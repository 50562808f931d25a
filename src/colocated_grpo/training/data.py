"""Prompt datasets: synthetic arithmetic (offline), GSM8K (hub), and any dataset of yours (`data=hub`, `data=local`).
Every row gets a `prompt` (chat messages, or plain text with `chat_template: false`) and, where there is a reference
answer, an `answer`; the other columns stay, for rewards of yours to read by name.

`problems` checks a data config (and local files' columns) before anything loads; `build` loads the dataset and
checks what it loaded."""

from __future__ import annotations

import difflib
import random
from collections.abc import Iterator
from itertools import groupby
from pathlib import Path

from omegaconf import OmegaConf

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
SOURCES = ("arithmetic", "gsm8k", "hub", "local")
OVERLONG = ("fail", "drop", "truncate")  # what to do with prompts over the length limit (training/prompt_lengths.py)
READERS = {"json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv"}


class DataError(ValueError):
    """The dataset cannot be used as configured; `problems` name each key and its fix."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


def arithmetic_problems(num_samples: int, max_operand: int, operations, seed: int) -> list[dict]:
    """Deterministic two-operand problems: [{"question": "37 + 5", "answer": "42"}, ...]."""
    if unknown := set(operations) - set(OPERATIONS):
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


def output_columns(data_cfg, source_columns: list[str] | None) -> set[str] | None:
    """The columns rows will have (what rewards can read), or None when the source's columns are not known yet."""
    if data_cfg.source in ("arithmetic", "gsm8k"):
        return {"prompt", "answer"}
    if source_columns is None:
        return None
    return {*source_columns, "prompt"} | ({"answer"} if data_cfg.get("answer_column") else set())


def problems(data_cfg, reward_columns: dict[str, list[str]]) -> list[str]:
    """Everything wrong with `data.*`, and the columns the rewards need (reward name -> its required columns), checked
    against the dataset where it can be read here (local files or directories; a hub dataset is checked once loaded)."""
    source = data_cfg.get("source")
    if source not in SOURCES:
        return [f"data.source={source!r} is unknown; choose one of {list(SOURCES)} (data=hub for a dataset of yours)"]
    found = _option_problems(data_cfg)
    columns = None
    if source in ("hub", "local") and not found and _is_local(data_cfg):
        try:
            columns = _load_source(data_cfg).column_names
        except DataError as err:
            return found + err.problems
    return found + column_problems(data_cfg, columns, reward_columns)


def column_problems(data_cfg, source_columns: list[str] | None, reward_columns: dict[str, list[str]]) -> list[str]:
    """The configured columns against the source's (when known), and what the rewards need against what rows have."""
    found = []
    where = _where(data_cfg)
    if source_columns is not None:
        for key in ("prompt_column", "answer_column"):
            column = data_cfg.get(key)
            if column is not None and column not in source_columns:
                fix = _closest(column, source_columns)
                also = " or data.answer_column=null for a prompt-only dataset" if key == "answer_column" else ""
                found.append(
                    f"data.{key}={column!r} is not a column of {where} (its columns: {source_columns}); "
                    f"set data.{key}={fix}{also}"
                )
    have = output_columns(data_cfg, source_columns)
    no_answer = data_cfg.source in ("hub", "local") and not data_cfg.get("answer_column")
    for reward, needed in reward_columns.items():
        for column in needed:
            if column == "answer" and no_answer and "answer" not in (source_columns or ()):
                found.append(
                    f"reward.weights.{reward}: '{reward}' needs a reference answer, and data.answer_column is null; "
                    "set data.answer_column=<the column holding the answer> or use rewards that need none "
                    "(e.g. reward=length or reward=length_chars)"
                )
            elif have is not None and column not in have:
                found.append(
                    f"reward.weights.{reward}: '{reward}' reads the dataset column '{column}', which {where} lacks "
                    f"(columns: {sorted(have)}); use another dataset or reward"
                )
    return found


def _option_problems(data_cfg) -> list[str]:
    found = []
    if (policy := data_cfg.get("overlong_prompts", "fail")) not in OVERLONG:
        found.append(f"data.overlong_prompts={policy!r} must be one of {list(OVERLONG)}")
    for key, what in (("max_prompt_tokens", "tokens, or null"), ("num_samples", "rows, or null for all")):
        value = data_cfg.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            found.append(f"data.{key}={value!r} must be a positive number of {what}")
    chat = data_cfg.get("chat_template", True)
    if not isinstance(chat, bool):
        found.append(f"data.chat_template={chat!r} must be true (chat messages) or false (plain text prompts)")
    elif not chat and data_cfg.get("system_prompt"):
        found.append(
            "data.system_prompt is set but data.chat_template=false: a plain-text prompt has no system turn; "
            "set data.chat_template=true or data.system_prompt=null"
        )
    if data_cfg.source == "local":
        found += _file_problems(data_cfg)
    if data_cfg.source in ("hub", "local") and not isinstance(data_cfg.get("prompt_column"), str):
        found.append("data.prompt_column must name the column holding the prompts (e.g. data.prompt_column=prompt)")
    return found


def _file_problems(data_cfg) -> list[str]:
    if OmegaConf.is_missing(data_cfg, "files"):
        return []  # reported with the other missing values
    found = []
    for f in _files(data_cfg):
        if (suffix := f.rsplit(".", 1)[-1].lower()) not in READERS:
            found.append(f"data.files={f!r}: cannot read '.{suffix}' files; use json, jsonl, parquet or csv")
        elif "://" not in f and not Path(f).expanduser().is_file():
            found.append(f"data.files={f!r}: no such file (give an existing json, jsonl, parquet or csv file)")
        elif "://" not in f and Path(f).expanduser().stat().st_size == 0:
            found.append(f"data.files={f!r} is empty: it holds no rows")
    return found


def build(data_cfg, reward_columns: dict[str, list[str]] | None = None):
    """The `datasets.Dataset` to train on; DataError names everything that does not fit, rewards' columns included."""
    ds = _build(data_cfg)
    found = []
    for reward, columns in (reward_columns or {}).items():
        for column in columns:
            if column not in ds.column_names:
                fix = "set data.answer_column=<the column holding the answer> or" if column == "answer" else ""
                found.append(
                    f"reward.weights.{reward}: '{reward}' reads the dataset column '{column}', which the rows of "
                    f"{_where(data_cfg)} lack (they have {ds.column_names}); {fix} use another reward"
                )
    if found:
        raise DataError(found)
    return ds


def _build(data_cfg):
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
        answer = lambda r: r["answer"].split("####")[-1].strip().replace(",", "")  # GSM8K's final answer follows ####
        row = lambda r: {"prompt": _conversation(r["question"], system_prompt), "answer": answer(r)}
        ds = ds.map(row, remove_columns=ds.column_names)
        return _limit(ds, data_cfg.get("num_samples"))
    ds = _load_source(data_cfg)
    if found := column_problems(data_cfg, ds.column_names, {}):
        raise DataError(found)
    prompt_col, answer_col = data_cfg.prompt_column, data_cfg.get("answer_column")
    chat = data_cfg.get("chat_template", True)

    def row(r):
        prompt = r[prompt_col]
        if isinstance(prompt, str) and chat:
            prompt = _conversation(prompt, system_prompt)
        out = {"prompt": prompt}
        if answer_col:
            out["answer"] = None if r[answer_col] is None else str(r[answer_col])
        return out

    drop = [prompt_col] if prompt_col != "prompt" else []
    return _limit(ds.map(row, remove_columns=drop), data_cfg.get("num_samples"))


def _load_source(data_cfg):
    """The dataset as stored: `files` (data=local) or `path` / `name` / `split` (data=hub; a local directory or file
    works the same way). Failures name the key to change."""
    import datasets

    try:
        files = _files(data_cfg) if data_cfg.source == "local" else None
        if files is None and (file := Path(str(data_cfg.path)).expanduser()).is_file():
            if file.stat().st_size == 0:
                raise DataError([f"data.path={str(data_cfg.path)!r} is empty: it holds no rows"])
            files = [str(file)]  # one data file: read as data=local reads its files
        if files is not None:  # data files, each read by its own extension (split: train), in their order
            by_reader = groupby(files, lambda f: READERS.get(f.rsplit(".", 1)[-1].lower(), "json"))
            parts = [datasets.load_dataset(r, data_files=list(g), split="train") for r, g in by_reader]
            ds = datasets.concatenate_datasets([p.cast(parts[0].features) for p in parts]) if parts[1:] else parts[0]
        else:
            ds = datasets.load_dataset(str(data_cfg.path), data_cfg.get("name"), split=data_cfg.split)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(
            [f"{_where(data_cfg)} cannot be read ({type(exc).__name__}: {exc}); {_source_fix(data_cfg)}"]
        ) from exc
    if len(ds) == 0:
        raise DataError([f"{_where(data_cfg)} holds no rows; {_source_fix(data_cfg)}"])
    return ds


def _is_local(data_cfg) -> bool:
    if data_cfg.source == "local":
        return not _file_problems(data_cfg) and all("://" not in f for f in _files(data_cfg))
    return not OmegaConf.is_missing(data_cfg, "path") and Path(str(data_cfg.path)).expanduser().exists()


def _files(data_cfg) -> list[str]:
    files = data_cfg.files
    return [str(files)] if isinstance(files, str) else [str(f) for f in files]


def _where(data_cfg) -> str:
    if data_cfg.source == "local":
        return f"data.files={_files(data_cfg)}" if not OmegaConf.is_missing(data_cfg, "files") else "data.files"
    name = f", data.name={data_cfg.get('name')!r}" if data_cfg.get("name") else ""
    return f"data.path={data_cfg.get('path')!r}{name} (split {data_cfg.get('split')!r})"


def _source_fix(data_cfg) -> str:
    if data_cfg.source == "local":
        return "give data.files=<json, jsonl, parquet or csv files with rows>"
    return (
        "give data.path=<hub dataset name or local directory or file>, data.name=<its config, if it has several> and "
        "data.split=<an existing split, e.g. train>"
    )


def _closest(column: str, columns: list[str]) -> str:
    close = difflib.get_close_matches(column, columns, n=1) or [
        c for c in ("prompt", "question", "problem", "messages", "text") if c in columns
    ]
    return close[0] if close else f"<one of {columns}>"


def _limit(ds, num_samples):
    return ds.select(range(min(num_samples, len(ds)))) if num_samples else ds
