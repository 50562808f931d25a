"""Write the table of trl.GRPOConfig's fields for the TRL and transformers installed into
src/colocated_grpo/training/grpo_fields.json, keeping the tables of other versions. Run it in each of .ci's installs
after a pin of either changes (tests/test_training_config.py checks the table of the versions installed):

    python tests/scripts/write_grpo_fields.py
"""

import importlib.metadata
import json
import types
import typing
from typing import Any, Literal, Union

from colocated_grpo.training.config import FIELD_TABLES, grpo_fields
from colocated_grpo.training.field_types import _by_value, _is_enum


def spell(annotation: Any) -> str:
    """`annotation` as text that config.grpo_fields reads back into one that `fits` and `describe` read alike: an enum
    as the Literal of its values, a type with no JSON form as Any (any value passes the check: its owner checks)."""
    annotation = _by_value(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return " | ".join(map(spell, args))
    if origin is Literal or _is_enum(annotation):
        return f"Literal[{', '.join(map(repr, args if origin is Literal else [m.value for m in annotation]))}]"
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else spell(a) for a in args)}]"
    if annotation in (bool, int, float, str, list, tuple, dict):
        return annotation.__name__
    return "None" if annotation is type(None) else "Any"


def field_table() -> dict:
    """GRPOConfig's init fields as grpo_fields.json holds them: name -> [type spelled, default as JSON]."""
    fields = {name: [spell(annotation), default] for name, (annotation, default) in grpo_fields(False).items()}
    versions = {name: importlib.metadata.version(name) for name in ("trl", "transformers")}
    return json.loads(json.dumps({"versions": versions, "fields": fields}, default=str))  # an enum as its value


def main() -> None:
    table = field_table()
    tables = [t for t in json.loads(FIELD_TABLES.read_text()) if t["versions"] != table["versions"]] + [table]
    tables.sort(key=lambda t: sorted(t["versions"].items()))
    lines = []
    for t in tables:  # a field a line: a new TRL's table differs from the last in the lines of the fields it changed
        fields = ",\n".join(f"   {json.dumps(name)}: {json.dumps(value)}" for name, value in t["fields"].items())
        lines.append(f' {{\n  "versions": {json.dumps(t["versions"])},\n  "fields": {{\n{fields}\n  }}\n }}')
    FIELD_TABLES.write_text("[\n" + ",\n".join(lines) + "\n]\n")
    print(f"{FIELD_TABLES}: the table of {table['versions']} ({len(table['fields'])} fields), {len(tables)} in all")


if __name__ == "__main__":
    main()
