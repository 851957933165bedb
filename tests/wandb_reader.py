"""A small reader for W&B's offline `.wandb` files, for tests (wandb 0.31 ships none).

Written for wandb >=0.31,<0.32 (pinned in pyproject.toml). The file is a 7-byte header (b":W&B", a
2-byte magic, a version byte) followed by a LevelDB-style log: 32 KiB blocks of records, each with a
7-byte header (crc32c: 4 bytes, length: 2 bytes little-endian, type: 1 byte: 1 full, 2 first,
3 middle, 4 last); a block tail shorter than 7 bytes is zero padding. Each assembled record is a
serialized `wandb.proto.wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: str | Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B log file")
    pos, out, parts = HEADER, [], []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if pos + HEADER + length > len(data):  # a record still being written
            break
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            parts = [chunk]
        elif kind == MIDDLE:
            parts.append(chunk)
        elif kind == LAST:
            out.append(b"".join([*parts, chunk]))
        elif kind == 0 and length == 0:
            pos += left - HEADER  # zero padding to the end of the block
        else:
            raise ValueError(f"bad record type {kind} at byte {pos}")
    return [wandb_internal_pb2.Record.FromString(b) for b in out]


def read_run(path: str | Path, wait_s: float = 60.0) -> dict[str, Any]:
    """The run's id, group, job type, tags, config (values decoded) and final summary.

    wandb-core writes the file from its own process; on a busy machine the run, history and summary
    records can land after `run.finish()` has returned (CI once read a report run with its run record
    but no history), so the reader waits up to `wait_s` for the run's last record, `exit`."""
    import time

    deadline = time.monotonic() + wait_s
    records = read_records(path)
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.5)
        records = read_records(path)
    info: dict[str, Any] = {"config": {}, "summary": {}, "tags": [], "history": []}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            info |= {"id": rec.run.run_id, "group": rec.run.run_group, "job_type": rec.run.job_type}
            info["tags"] = list(rec.run.tags)
            for item in rec.run.config.update:
                info["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                info["config"][item.key] = json.loads(item.value_json)
        elif kind == "summary":
            for item in rec.summary.update:
                key = item.key or "/".join(item.nested_key)
                info["summary"][key] = json.loads(item.value_json)
        elif kind == "history":
            info["history"].append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            )
    return info
