"""CUPTI activity buffers built the way libcupti fills them, for tests without a GPU.

Records are written with cupti-python's numpy dtypes (``activity_kernel10_dtype``, ...), which NVIDIA
generates from ``cupti_activity.h``: an independent source of the struct layouts, checked against
the offsets :mod:`plasmient_trace.capture.cupti_records` reads. A record is given as attributes
named like cupti-python's activity classes (``device_id``, ``correlation_id``, ``grid_x``, ...);
kernel names become fake pointers resolved through ``RawActivity.names``.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from plasmient_trace.capture import cupti_records as cr

DTYPE_NAMES = {cr.KIND_CONCURRENT_KERNEL: "activity_kernel10_dtype", cr.KIND_KERNEL: "activity_kernel10_dtype",
               cr.KIND_RUNTIME: "activity_api_dtype", cr.KIND_DRIVER: "activity_api_dtype",
               cr.KIND_MEMCPY: "activity_memcpy6_dtype", cr.KIND_MEMSET: "activity_memset4_dtype",
               cr.KIND_SYNCHRONIZATION: "activity_synchronization2_dtype",
               cr.KIND_EXTERNAL_CORRELATION: "activity_external_correlation_dtype"}


_POINTERS: dict[str, int] = {}  # one fake address per kernel name, across every buffer of the test run


def dtypes() -> dict[int, np.dtype]:
    from cupti import cupti

    return {kind: getattr(cupti, name) for kind, name in DTYPE_NAMES.items()}


def pack(records: Iterable[Any]) -> cr.RawActivity:
    """One buffer holding ``records`` (objects or dicts), in order."""
    types = dtypes()
    names: dict[int, str] = {}
    chunks = []
    for record in records:
        fields = dict(record if isinstance(record, dict) else vars(record))
        kind = int(fields["kind"])
        row = np.zeros(1, types[kind])
        if "name" in fields and kind in (cr.KIND_CONCURRENT_KERNEL, cr.KIND_KERNEL):
            text = fields.pop("name")
            pointer = _POINTERS.setdefault(text, 0x10_0000 + 64 * len(_POINTERS))
            names[pointer] = text
            fields["name"] = pointer
        for key, value in fields.items():
            if key in row.dtype.names and value is not None:
                row[key] = value
        chunks.append(row.view(np.uint8))
    data = np.concatenate(chunks) if chunks else np.empty(0, np.uint8)
    return cr.RawActivity(buffers=[data], sizes={k: t.itemsize for k, t in types.items()}, names=names)


def tables_of(records: Iterable[Any], epoch_offset_ns: int = 0, api_name: Any = None) -> dict:
    """``records`` packed into one buffer and turned into record tables by the live code path."""
    from plasmient_trace.capture import cupti

    return cupti.tables(pack(records), epoch_offset_ns, api_name or cupti.default_api_name)
