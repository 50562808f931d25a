"""Reward functions and their registry. A reward is a pure function `f(completions: list[str], **columns) ->
list[float | None]`: one score per completion, `None` where it does not apply (TRL then ignores it). `columns` are
the dataset's columns (e.g. `answer`) and TRL's extras (`completion_ids`, ...).

Rewards of your own: `@register` them in a module named in `reward.modules` (importable from PYTHONPATH; see
examples/my_rewards.py); their keyword parameters with defaults are set in `reward.params.<name>`, those without
are dataset columns. A NaN or infinite score stops the run (`run.stop_on_nonfinite`): return None, not NaN.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
import re
import typing
from collections.abc import Callable

from colocated_grpo.training.field_types import describe, fits

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
    for text, gold in zip(completions, answer, strict=True):
        boxed = _BOXED.findall(text)
        numbers = _NUMBER.findall(boxed[-1] if boxed else text)
        scores.append(None if gold is None else float(bool(numbers) and numbers[-1] == str(gold).strip()))
    return scores


@register
def math_accuracy(completions: list[str], answer: list[str], **_) -> list[float | None]:
    """1.0 when math-verify finds the completion's answer equivalent to `answer` (LaTeX, fractions, ...)."""
    from math_verify import parse, verify

    golds = [parse(str(gold)) if gold is not None else [] for gold in answer]
    # None for an unparsable reference: it says nothing about the completion
    return [float(verify(gold, parse(text))) if gold else None for text, gold in zip(completions, golds, strict=True)]


@register
def boxed_format(completions: list[str], **_) -> list[float]:
    """1.0 when the completion gives exactly one final answer in \\boxed{...}."""
    return [float(len(_BOXED.findall(text)) == 1) for text in completions]


@register
def length(
    completions: list[str], completion_ids: list[list[int]] | None = None, target: int = 256, **_
) -> list[float]:
    """1 at `target` tokens, falling linearly to 0 at 0 and 2×target tokens (characters if no ids are given)."""
    sizes = [len(ids) for ids in completion_ids] if completion_ids is not None else [len(t) for t in completions]
    return [max(0.0, 1.0 - abs(n - target) / target) for n in sizes]


@register
def even_token_share(completions: list[str], completion_ids: list[list[int]], **_) -> list[float]:
    """The share of even token ids in each completion: every sampled token bears on it, so even a random-weight
    model's policy moves every step (learning checks; reward=even_tokens)."""
    return [sum(t % 2 == 0 for t in ids) / max(1, len(ids)) for ids in completion_ids]


@register
def length_chars(completions: list[str], target: int = 20, **_) -> list[float]:
    """-|target - characters| (TRL's GRPO example reward, `-abs(20 - len(completion))`)."""
    return [-float(abs(target - len(text))) for text in completions]


# What TRL passes every reward besides the dataset's columns: not parameters to set in reward.params.
TRL_EXTRAS = ("prompts", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


def _named(name: str, after_first: bool = False) -> list[inspect.Parameter]:
    """Reward `name`'s parameters passed by name (after `completions` with `after_first`), bar TRL's extras."""
    params = list(inspect.signature(REGISTRY[name]).parameters.values())[int(after_first) :]
    return [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in TRL_EXTRAS]


def parameters(name: str) -> dict[str, inspect.Parameter]:
    """The settable parameters of a registered reward: keyword parameters with a default, other than TRL's extras."""
    return {p.name: p for p in _named(name) if p.default is not p.empty}


def required_columns(name: str) -> list[str]:
    """The dataset columns a registered reward needs: its parameters without a default, after `completions`."""
    return [p.name for p in _named(name, after_first=True) if p.default is p.empty]


def columns_needed(names) -> dict[str, list[str]]:
    """Reward name -> the dataset columns it needs, for the registered ones among `names`."""
    return {name: required_columns(name) for name in names if name in REGISTRY}


def problems(weights: dict, params: dict) -> list[str]:
    """`reward.weights` and `reward.params` against the registry (modules already imported): unknown rewards,
    weights that are not numbers, parameters a reward does not take or of the wrong type."""
    found = []
    if not weights:
        found.append(f"reward.weights is empty; name at least one of {sorted(REGISTRY)} (e.g. reward.weights.length=1)")
    for name, weight in weights.items():
        if name not in REGISTRY:
            close = difflib.get_close_matches(name, REGISTRY, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            found.append(f"reward.weights.{name}: unknown reward '{name}'{hint}; registered: {sorted(REGISTRY)}")
        elif not fits(weight, float):
            found.append(f"reward.weights.{name}={weight!r} must be a number (the weight of '{name}' in the sum)")
        elif not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(REGISTRY[name]).parameters.values()):
            found.append(
                f"reward.weights.{name}: '{name}' must take **kwargs (TRL passes every reward the dataset's columns "
                "and its own extras, e.g. trainer_state)"
            )
    for name, values in (params or {}).items():
        if name not in weights:
            found.append(
                f"reward.params.{name}: no reward '{name}' in reward.weights {sorted(weights)}; add "
                f"reward.weights.{name}=<weight> or remove reward.params.{name}"
            )
            continue
        if name not in REGISTRY:
            continue  # reported above
        accepted = parameters(name)
        try:
            hints = typing.get_type_hints(REGISTRY[name])
        except Exception:  # annotations that do not resolve: leave the values to the reward
            hints = {}
        for key, value in (values or {}).items():
            if key not in accepted:
                close = difflib.get_close_matches(key, accepted, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                found.append(
                    f"reward.params.{name}.{key}: reward '{name}' takes no parameter '{key}'{hint}; its parameters: "
                    f"{sorted(accepted) or 'none'}"
                )
            elif key in hints and not fits(value, hints[key]):
                found.append(f"reward.params.{name}.{key}={value!r} must be {describe(hints[key])}")
    return found


def load_modules(names) -> None:
    """Import the modules named in `reward.modules`, so that the rewards they `@register` exist."""
    for name in names or ():
        importlib.import_module(str(name))


class RewardError(RuntimeError):
    pass


class NonFiniteRewardError(RewardError):
    pass


def completion_text(completion) -> str:
    """TRL passes plain strings for text prompts and a list of messages for conversational ones."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion if m.get("role", "assistant") == "assistant")


def for_trl(name: str, params: dict | None = None, check_finite: bool = True) -> RewardFn:
    """A registered reward in TRL's calling convention, naming the function (and sample) if it raises and, with
    `check_finite`, the sample it returned NaN or inf for."""
    fn = REGISTRY[name]
    params = dict(params or {})

    @functools.wraps(fn)
    def reward(prompts, completions, **columns):
        texts = [completion_text(c) for c in completions]
        try:
            scores = fn(texts, **columns, **params)
        except Exception as exc:
            raise _raised(name, exc, texts, columns) from exc
        if check_finite:
            for i, score in enumerate(scores):
                if score is not None and not math.isfinite(score):
                    raise NonFiniteRewardError(
                        f"reward '{name}' returned {score} for {_sample(texts, columns, i)}. A reward must be a "
                        "finite number, or None where it does not apply (set run.stop_on_nonfinite=false to pass "
                        "it on to TRL, which ignores NaN like None and turns inf into a NaN loss)"
                    )
        return scores

    return reward


def _raised(name: str, exc: Exception, texts: list[str], columns: dict) -> RewardError:
    """The error for a reward that raised on a batch; the failing sample is known only for a batch of one (calling the
    reward again could have side effects). The batch's samples go with the error, into the log file's traceback."""
    said = f"reward '{name}' raised {type(exc).__name__}: {exc}"
    if len(texts) == 1:
        return RewardError(f"{said} on {_sample(texts, columns, 0)}")
    error = RewardError(
        f"{said} on a batch of {len(texts)} samples (which one is not known without calling the reward again; "
        "the samples are listed with this error's traceback in train.log)"
    )
    for i in range(len(texts)):
        error.add_note(_sample(texts, columns, i))
    return error


def _sample(texts: list[str], columns: dict, i: int) -> str:
    """Sample i of a batch: its completion and its own value of each per-sample column."""
    n = len(texts)
    row = {k: v[i] for k, v in columns.items() if isinstance(v, list) and len(v) == n and k != "completion_ids"}
    return f"sample {i}: completion={texts[i][:200]!r} columns={row}"


def weighted_total(scores: list[list], weights: list[float]) -> list[float | None]:
    """Each completion's reward as TRL sums it (its `reward` metric): the weighted sum of the scores of each reward
    function (`scores`, one list per function), a None or NaN score left out; None where every score is."""
    totals = []
    for row in zip(*scores, strict=True):
        given = [w * s for w, s in zip(weights, row, strict=True) if s is not None and not math.isnan(s)]
        totals.append(sum(given) if given else None)
    return totals


def build(reward_cfg, check_finite: bool = True) -> tuple[list[RewardFn], list[float]]:
    """TRL reward functions and their weights from `reward.weights` (name -> weight) and `reward.params`."""
    load_modules(reward_cfg.get("modules"))
    params = reward_cfg.get("params") or {}
    names = list(reward_cfg.weights)
    funcs = [for_trl(n, params.get(n), check_finite) for n in names]
    return funcs, [float(reward_cfg.weights[n]) for n in names]
