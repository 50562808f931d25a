"""W&B's offline transaction log, which W&B does not document: `<wandb>/<offline-run-…-ID>/run-ID.wandb`, in LevelDB
log format (32 KiB blocks of checksummed chunks) holding `wandb_internal_pb2.Record` messages. Reading it (and
truncating it at a record boundary) is what lets a resumed run keep every step in W&B exactly once."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

_BLOCK, _CHUNK_HEADER, _FILE_HEADER = 32768, 7, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[tuple[int, object]]:
    """(byte offset where the record starts, Record) for every complete record of a W&B transaction log."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        return
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
            except DecodeError:
                return
            yield start, record
            start, parts = None, []


def history(path: Path) -> list[dict]:
    """The history rows of one transaction log: {"_step": n, key: value, ...} in the order they were logged."""
    rows = []
    for _, record in records(path):
        if is_history(record):
            rows.append(history_row(record))
    return rows


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


def truncate(log_file: Path, offset: int) -> None:
    """Cut a transaction log at a record's start: as if the writer had died right before that record."""
    with open(log_file, "r+b") as f:
        f.truncate(offset)


def trainer_metric_names(values: dict) -> dict:
    """Metrics named as transformers' W&B callback names them (TRL's `reward` → `train/reward`), so that rows logged
    later (a resumed run's backfill) land beside the rows the trainer logged."""
    from transformers.integrations.integration_utils import rewrite_logs

    return rewrite_logs(values)
