"""Every prompt measured in the model's tokens (chat template included) against the length it may have, before the
model loads (vLLM would fail at the first step). Over-long prompts fail the run, are dropped or are truncated (their
start cut), as `data.overlong_prompts` says."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PromptReport:
    """What was done to the prompts; recorded in run.json as `prompts`."""

    rows: int
    limit_tokens: int | None
    limit_from: str
    longest_tokens: int
    overlong: int
    policy: str
    dropped: int = 0
    truncated: int = 0


def prompt_limit(max_prompt_tokens, engine_length, completion: int, context) -> tuple[int | None, str, str]:
    """(the most tokens a prompt may have, the keys it comes from, how to make more room): data.max_prompt_tokens if
    set, else what trainer.vllm_max_model_length (or, unset, the model's context) leaves after
    trainer.max_completion_length. Raising vllm_max_model_length is suggested only while it is below the context."""
    if max_prompt_tokens:
        return int(max_prompt_tokens), "data.max_prompt_tokens", "raise data.max_prompt_tokens"
    room = "lower trainer.max_completion_length"
    if engine_length:
        if not context or engine_length < context:
            most = f" (at most {context}, the model's context)" if context else ""
            room = f"raise trainer.vllm_max_model_length{most} or {room}"
        return int(engine_length) - completion, "trainer.vllm_max_model_length - trainer.max_completion_length", room
    if context:
        return int(context) - completion, "the model's max_position_embeddings - trainer.max_completion_length", room
    return None, "none (the model's context is unknown)", room


def measure(dataset, tokenizer):
    """The dataset with a `_prompt_tokens` column: each prompt's length as the model will see it."""
    count = lambda batch: {"_prompt_tokens": [len(_ids(tokenizer, p)) for p in batch["prompt"]]}
    return dataset.map(count, batched=True, desc="measuring prompts")


def fit(dataset, tokenizer, limit: int | None, limit_from: str, room: str, policy: str):
    """(dataset whose prompts fit in `limit` tokens, PromptReport, problems): `fail` reports a prompt too long, naming
    the keys to change (`room`: how to make more room); `drop` and `truncate` fix the data instead."""
    lengths = measure(dataset, tokenizer)["_prompt_tokens"]
    longest = max(lengths, default=0)
    over = [i for i, n in enumerate(lengths) if limit is not None and n > limit]
    over_set = set(over)
    report = PromptReport(len(lengths), limit, limit_from, longest, len(over), policy)
    if not over:
        return dataset, report, []
    room = f"make room: {room}"
    if policy == "fail":
        problem = (
            f"data: {len(over)} of {len(lengths)} prompts are longer than {limit} tokens ({limit_from}); the "
            f"longest has {longest} (row {lengths.index(longest)}). Set data.overlong_prompts=truncate (keep each "
            f"prompt's end) or data.overlong_prompts=drop, or {room}"
        )
        return dataset, report, [problem]
    if policy == "drop":
        keep = [i for i in range(len(lengths)) if i not in over_set]
        report.dropped = len(over)
        if not keep:
            return dataset, report, [f"data: every prompt is longer than {limit} tokens ({limit_from}); {room}"]
        return dataset.select(keep), report, []
    truncated = dataset.map(
        lambda row, i: {"prompt": truncate(row["prompt"], tokenizer, limit)} if i in over_set else {},
        with_indices=True,
        desc="truncating prompts",
    )
    report.truncated = len(over)
    left = [len(_ids(tokenizer, p)) for p in truncated.select(over)["prompt"]]
    if cannot := [(row, n) for row, n in zip(over, left, strict=True) if n > limit]:
        problem = (
            f"data: {len(cannot)} of {len(lengths)} prompts cannot be cut to {limit} tokens ({limit_from}): what "
            f"comes before their last message's text (chat template, system prompt, earlier messages) is longer; "
            f"row {cannot[0][0]} still has {cannot[0][1]}. Set data.overlong_prompts=drop, shorten "
            f"data.system_prompt, or {room}"
        )
        return dataset, report, [problem]
    return truncated, report, []


def said(prompts: dict | None) -> str | None:
    """The console line for the prompts data.overlong_prompts dropped or cut (`prompts`: PromptReport as a dict)."""
    if not prompts or not (prompts["dropped"] or prompts["truncated"]):
        return None
    done = f"dropped {prompts['dropped']}" if prompts["dropped"] else f"cut the start of {prompts['truncated']}"
    return (
        f"data.overlong_prompts={prompts['policy']}: {done} of {prompts['rows']} prompts, longer than "
        f"{prompts['limit_tokens']} tokens ({prompts['limit_from']}; the longest had {prompts['longest_tokens']})"
    )


def truncate(prompt, tokenizer, limit: int):
    """The prompt cut from its start (of its text, or of the last message's content) until it has `limit` tokens."""
    for _ in range(8):  # decoding and re-encoding can merge tokens differently: measure again
        excess = len(_ids(tokenizer, prompt)) - limit
        if excess <= 0:
            return prompt
        if isinstance(prompt, str):
            prompt = _cut(tokenizer, prompt, excess)
        else:
            last = dict(prompt[-1])
            last["content"] = _cut(tokenizer, last["content"], excess)
            prompt = [*prompt[:-1], last]
    return prompt


def _cut(tokenizer, text: str, tokens: int) -> str:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer.decode(ids[tokens:])


def _ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
