"""A Kineto trace's document-level facts: the clock anchor, the devices (``deviceProperties``) and the
resource (``distributedInfo``, the main pid), with the lenient id reading they share with the event pass.

Values here come from outside and flow into resource attributes and trace ids, so each is checked for type
and range; anything else reads as unknown (absent), never as an error.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np

from ..records import DeviceInfo
from .validate import MAX_ABS_TS_US

INT64_MAX = 2**63 - 1
# Device props and distributed info flow into resource attributes and trace ids: keep them sane.
_MAX_RANK = 2**31 - 1
# Kineto writes epoch microseconds (>= 2001-09-09) when it has no baseTimeNanoseconds anchor.
_EPOCH_US_THRESHOLD = 1.0e15


def as_int(value: Any) -> int:
    """pid/tid are ints in current Kineto, strings ('25738', 'stream 7') in older files."""
    if isinstance(value, float):
        value = int(value) if math.isfinite(value) else -1
    elif isinstance(value, str):
        digits = value.rsplit(" ", 1)[-1]
        value = int(digits) if digits.lstrip("-").isdigit() else zlib.crc32(value.encode())
    if isinstance(value, int) and -INT64_MAX <= value <= INT64_MAX:
        return value
    return -1  # unknown: absent, not a number, or no int64 id


def clock_anchor(meta: dict[str, Any], ts_columns: list[np.ndarray]) -> tuple[int, str]:
    """The ns every event's µs offset is added to, and whether the clock is the epoch or relative."""
    base = meta.get("baseTimeNanoseconds")
    # An anchor past 2096 cannot be real and would overflow int64 ns with the µs offsets added to it.
    if isinstance(base, (int, float)) and not isinstance(base, bool) and 0 < base < MAX_ABS_TS_US * 1000:
        return int(base), "epoch"
    first = next((float(col[0]) for col in ts_columns if len(col)), None)
    if first is not None and first >= _EPOCH_US_THRESHOLD:
        return 0, "epoch"
    return 0, "relative"


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= INT64_MAX else None


def devices_of(meta: dict[str, Any]) -> list[DeviceInfo]:
    """The GPUs ``deviceProperties`` describes (none: the device is unknown)."""
    props_list = meta.get("deviceProperties")
    if not isinstance(props_list, list):
        return []  # absent, or not the list Kineto writes: the device is unknown, not an error
    out = []
    for props in props_list:
        if not isinstance(props, dict) or not isinstance(props.get("name"), str):
            continue
        out.append(DeviceInfo(
            ordinal=as_int(props.get("id", len(out))), name=props["name"],
            sm_count=_positive_int(props.get("numSms")), memory_bytes=_positive_int(props.get("totalGlobalMem")),
            properties=dict(props),
        ))
    return out


def resource_of(meta: dict[str, Any], pids: list[int]) -> dict[str, Any]:
    """Rank, world size and backend from ``distributedInfo``, and the pid most events came from."""
    resource: dict[str, Any] = {}
    dist = meta.get("distributedInfo")
    if isinstance(dist, dict):
        rank, world = dist.get("rank"), dist.get("world_size")
        if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank <= _MAX_RANK:
            resource["plasmient.rank"] = rank
        if isinstance(world, int) and not isinstance(world, bool) and 0 < world <= _MAX_RANK:
            resource["plasmient.world_size"] = world
        if isinstance(dist.get("backend"), str):
            resource["plasmient.distributed.backend"] = dist["backend"]
    if pids:
        values, counts = np.unique(np.asarray(pids, dtype=np.int64), return_counts=True)
        resource["process.pid"] = int(values[np.argmax(counts)])
    return resource
