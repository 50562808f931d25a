"""Is a config value of the type a dataclass field or a function parameter declares? Used on `trainer.*` (against
trl.GRPOConfig's fields) and `reward.params.*` (against the reward's parameters), so that a wrong value is reported
with its key before anything loads instead of failing deep inside TRL or transformers."""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any, Literal, Union


def fits(value: Any, annotation: Any) -> bool:
    """True when `value` (as OmegaConf gives it: int, float, bool, str, None, list, dict) can be passed as a value of
    `annotation`. Types this does not know (classes of objects, callables) pass: their owner checks them."""
    if annotation is Any or annotation is dataclasses.MISSING:
        return True
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(fits(value, a) for a in _alternatives(annotation))
    if origin is Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return value in {m.value for m in annotation}
    if annotation in (list, tuple) or origin in (list, tuple):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return isinstance(value, list | tuple) and all(fits(v, args[0]) for v in value) if args else True
    if annotation is dict or origin is dict:
        return isinstance(value, dict)
    return True


def describe(annotation: Any) -> str:
    """The values `annotation` takes, in words: 'an integer', 'a number or null', "one of ['linear', 'cosine']"."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe(a) for a in _alternatives(annotation)))
    if origin is Literal:
        return f"one of {list(typing.get_args(annotation))}"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return f"one of {[m.value for m in annotation]}"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    if annotation in words:
        return words[annotation]
    if annotation in (list, tuple) or origin in (list, tuple):
        return "a list"
    if annotation is dict or origin is dict:
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def _alternatives(annotation: Any) -> list:
    """A union's members; `SomeEnum | str` (transformers' way of taking an enum's value) means the enum's values."""
    args = list(typing.get_args(annotation))
    if any(isinstance(a, type) and issubclass(a, enum.Enum) for a in args):
        args = [a for a in args if a is not str]
    return args


@functools.cache
def dataclass_fields(cls: type) -> dict[str, tuple[Any, Any]]:
    """name -> (annotation, default) of every init field of a dataclass (default MISSING where it has none)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        out[f.name] = (hints.get(f.name, Any), default)
    return out
