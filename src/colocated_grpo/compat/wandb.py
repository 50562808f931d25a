"""W&B's offline transaction log, which W&B does not document: `<wandb>/<offline-run-…-ID>/run-ID.wandb`, in LevelDB
log format (32 KiB blocks of checksummed chunks) holding `wandb_internal_pb2.Record` messages. Reading it (and
truncating it at a record boundary) is what lets a resumed run keep every step in W&B exactly once. The format may
change with any W&B release: the reader refuses (UnknownFormat) a W&B outside TESTED (the range pyproject.toml pins)
or a log it does not recognise, and a resumed run then starts a new W&B run instead (resilience/attempts.py).
Also: whether W&B holds credentials for its server (`missing_credentials`)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

TESTED = ("0.31", "0.32")  # W&B versions whose offline log this reader was checked against: >= first, < second
_HEADER = b":W&B\xe1\xbe\x00"  # ident, magic 0xBEE1 (little-endian), format version 0
_BLOCK, _CHUNK_HEADER, _FILE_HEADER = 32768, 7, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class UnknownFormat(RuntimeError):
    """The offline log cannot be read safely: an untested W&B, or bytes that are not the known format."""


def check_version() -> None:
    from packaging.version import Version

    version = metadata.version("wandb")
    if not Version(TESTED[0]) <= Version(version) < Version(TESTED[1]):
        raise UnknownFormat(f"wandb {version} is outside the versions its offline log was checked with ({TESTED})")


def records(path: Path) -> Iterator[tuple[int, object]]:
    """(byte offset where the record starts, Record) for every complete record of a W&B transaction log."""
    check_version()
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if len(data) < _FILE_HEADER:
        return  # the writer died before its header: nothing logged
    if data[:_FILE_HEADER] != _HEADER:
        raise UnknownFormat(f"{path} does not start with the header of W&B's offline log format 0")
    pos, start, parts = _FILE_HEADER, None, []
    while pos + _CHUNK_HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _CHUNK_HEADER:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        end = pos + _CHUNK_HEADER + length
        if kind not in (_FULL, _FIRST, _MIDDLE, _LAST) or end > len(data):
            return  # zero padding or a chunk torn by a killed writer: nothing complete follows
        chunk = data[pos + _CHUNK_HEADER : end]
        if kind in (_FULL, _FIRST):
            start, parts = pos, [chunk]
        else:
            parts.append(chunk)
        pos = end
        if kind in (_FULL, _LAST) and start is not None:
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(b"".join(parts))
            except DecodeError as err:  # a complete record that does not parse: not the format we know
                raise UnknownFormat(f"{path}: the record at byte {start} is not a W&B Record ({err})") from err
            yield start, record
            start, parts = None, []


def history(path: Path) -> list[dict]:
    """The history rows of one transaction log: {"_step": n, key: value, ...} in the order they were logged."""
    return [history_row(record) for _, record in records(path) if is_history(record)]


def history_row(record) -> dict:
    row = {"_step": record.history.step.num}
    for item in record.history.item:
        key = item.key or "/".join(item.nested_key)
        try:
            row[key] = json.loads(item.value_json)
        except ValueError:
            row[key] = item.value_json
    return row


def is_history(record) -> bool:
    return record.WhichOneof("record_type") == "history"


def trainer_metric_names(values: dict) -> dict:
    """Metrics named as transformers' W&B callback names them (TRL's `reward` → `train/reward`), so that rows logged
    later (a resumed run's backfill) land beside the rows the trainer logged."""
    from transformers.integrations.integration_utils import rewrite_logs

    return rewrite_logs(values)


def server() -> str:
    """The W&B server a run would talk to (WANDB_BASE_URL or W&B's settings)."""
    from wandb.sdk import wandb_setup

    return wandb_setup.singleton().settings.base_url


def missing_credentials() -> str | None:
    """None when W&B has credentials for `server()`, else why not, in one sentence; found as `wandb.init` finds them,
    without a prompt or a request (wandb's own `wbauth.authenticate_session`, not public API)."""
    from wandb.errors import AuthenticationError
    from wandb.sdk.lib import wbauth

    host = server()
    try:
        auth = wbauth.authenticate_session(host=host, source="colocated_grpo", prompt=False, update_session=False)
    except AuthenticationError as err:  # a key that cannot be one (e.g. too short), before any request
        return str(err)
    return None if auth is not None else f"none found for {host}"
