"""Is a config value of the type a field declares? Checks `trainer.*` against trl.GRPOConfig and `reward.params.*`
against the reward's parameters, so that a wrong value is reported with its key before anything loads."""

from __future__ import annotations

import enum
import functools
import json
import types
import typing
from typing import Any, Literal, Union

import pydantic


def fits(value: Any, annotation: Any) -> bool:
    """True when `value` (as OmegaConf gives it) fits `annotation`, read strictly as JSON by pydantic (true is no
    integer, an enum is given by its value). Types with no JSON form (objects, callables) pass: their owner checks."""
    adapter = _adapter(_by_value(annotation))
    if adapter is None:
        return True
    try:
        adapter.validate_json(json.dumps(value), strict=True)
        return True
    except pydantic.ValidationError:
        return False


@functools.cache
def _adapter(annotation: Any) -> pydantic.TypeAdapter | None:
    try:
        adapter = pydantic.TypeAdapter(annotation)
        adapter.json_schema()  # refuses callables, which no config value can be
    except (pydantic.PydanticSchemaGenerationError, pydantic.errors.PydanticInvalidForJsonSchema):
        return None
    return adapter


def describe(annotation: Any) -> str:
    """The values `annotation` takes, in words: 'an integer', 'a number or null', "one of ['linear', 'cosine']"."""
    annotation = _by_value(annotation)
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return " or ".join(dict.fromkeys(describe(a) for a in typing.get_args(annotation)))
    if origin is Literal:
        return f"one of {list(typing.get_args(annotation))}"
    if _is_enum(annotation):
        return f"one of {[m.value for m in annotation]}"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    if annotation in words:
        return words[annotation]
    if annotation in (list, tuple) or origin in (list, tuple):
        return "a list"
    if annotation is dict or origin is dict:
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def _by_value(annotation: Any) -> Any:
    """`SomeEnum | str` (transformers' way of taking an enum's value) means the enum's values: the str goes."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (Union, types.UnionType) and any(map(_is_enum, args)):
        return Union[tuple(a for a in args if a is not str)]  # noqa: UP007 (a union built from a tuple)
    return annotation


def _is_enum(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, enum.Enum)
