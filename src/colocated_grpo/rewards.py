"""Reward functions and their registry.

A reward is a pure function `f(completions: list[str], **columns) -> list[float | None]`: one score per
completion, `None` where it does not apply (TRL then ignores it). `columns` are the dataset's columns (e.g.
`answer`) and TRL's extras (`completion_ids`, ...). Math answers are checked with math-verify.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

RewardFn = Callable[..., list]
REGISTRY: dict[str, RewardFn] = {}

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def register(fn: RewardFn) -> RewardFn:
    REGISTRY[fn.__name__] = fn
    return fn


@register
def exact_answer(completions: list[str], answer: list[str], **_) -> list[float | None]:
    """1.0 when the final answer (the last \\boxed{} if any, else the last number) equals `answer` exactly."""
    scores = []
    for text, gold in zip(completions, answer):
        if gold is None:
            scores.append(None)
            continue
        boxed = _BOXED.findall(text)
        numbers = _NUMBER.findall(boxed[-1] if boxed else text)
        scores.append(float(bool(numbers) and numbers[-1] == str(gold).strip()))
    return scores


@register
def math_accuracy(completions: list[str], answer: list[str], **_) -> list[float | None]:
    """1.0 when math-verify finds the completion's answer equivalent to `answer` (LaTeX, fractions, ...)."""
    from math_verify import parse, verify

    scores = []
    for text, gold in zip(completions, answer):
        gold_parsed = parse(str(gold)) if gold is not None else []
        if not gold_parsed:
            scores.append(None)  # an unparsable reference says nothing about the completion
            continue
        scores.append(float(verify(gold_parsed, parse(text))))
    return scores


@register
def boxed_format(completions: list[str], **_) -> list[float]:
    """1.0 when the completion gives exactly one final answer in \\boxed{...}."""
    return [float(len(_BOXED.findall(text)) == 1) for text in completions]


@register
def length(completions: list[str], completion_ids: list[list[int]] | None = None, target: int = 256, **_) -> list[float]:
    """1 at `target` tokens, falling linearly to 0 at 0 and 2×target tokens (characters if no ids are given)."""
    sizes = [len(ids) for ids in completion_ids] if completion_ids is not None else [len(t) for t in completions]
    return [max(0.0, 1.0 - abs(n - target) / target) for n in sizes]


class RewardError(RuntimeError):
    pass


def completion_text(completion) -> str:
    """TRL passes plain strings for text prompts and a list of messages for conversational ones."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant")


def for_trl(name: str, params: dict | None = None) -> RewardFn:
    """Adapt a registered reward to TRL's calling convention, naming the function and sample if it raises."""
    fn = REGISTRY[name]
    params = dict(params or {})

    @functools.wraps(fn)
    def reward(prompts, completions, **columns):
        texts = [completion_text(c) for c in completions]
        try:
            return fn(texts, **columns, **params)
        except Exception as exc:  # find the first failing sample so the message points at real data
            for i, text in enumerate(texts):
                row = {k: v[i : i + 1] for k, v in columns.items() if isinstance(v, list) and len(v) == len(texts)}
                try:
                    fn([text], **row, **params)
                except Exception:
                    raise RewardError(
                        f"reward '{name}' raised {type(exc).__name__}: {exc} on sample {i}: "
                        f"completion={text[:200]!r} columns={ {k: v[0] for k, v in row.items()} }"
                    ) from exc
            raise RewardError(f"reward '{name}' raised {type(exc).__name__}: {exc}") from exc

    return reward


def build(reward_cfg) -> tuple[list[RewardFn], list[float]]:
    """TRL reward functions and their weights from `reward.weights` (name -> weight) and `reward.params`."""
    params = reward_cfg.get("params") or {}
    names = list(reward_cfg.weights)
    return [for_trl(n, params.get(n)) for n in names], [float(reward_cfg.weights[n]) for n in names]
