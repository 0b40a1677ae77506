"""OTLP protobuf: encode a SpanBatch to serialized ``ExportTraceServiceRequest`` bytes.

One request per trace, split into several requests where a trace would exceed ``max_bytes``
(default 3.5 MiB, under gRPC's 4 MiB default receive limit).

The wire format is written by hand, column-wise, with the piece machinery of :mod:`.otlp_json`:
per chunk, each span's header (ids, times, lengths as vectorised varints) is one piece, the name
another, and every attribute one or two (KeyValue framing as a constant per value length, then the
value bytes); one ``take`` lays the spans out, and only request/resource/scope framing is Python.
The generated classes (``trace_pb2``, one message per span and per attribute) measured ~3,800
spans/s against ~80,000-100,000 for this path on the same machine (``benchmarks/bench_encode.py
--generated``), so they only build the few resources and the scope.

The output parses with ``ExportTraceServiceRequest.FromString`` and means the same as the OTLP/JSON
lines of :mod:`.otlp_json` (same grouping, same dropped non-finite doubles). Span fields are written
in the order ids, kind, times, name, attributes, which protobuf parsers accept like any order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from plasmient_trace.conventions import SCOPE_NAME, SpanBatch
from plasmient_trace.export.otlp_json import SPAN_KIND_INTERNAL, package_version
from plasmient_trace.export.pieces import LB, Pieces, Varint, build_rows, u64_be_matrix, u64_le_matrix, varint_array
from plasmient_trace.export.span_columns import (
    CHUNK_ROWS,
    AttributeValues,
    attribute_slots,
    attribute_values,
    column_array,
    id_matrix,
    iter_segments,
    span_layout,
)

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "encode_requests", "varint", "any_value_proto"]

DEFAULT_MAX_REQUEST_BYTES = int(3.5 * 1024 * 1024)


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int (negative int64s: pass value & (2**64 - 1))."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _lengths(arr: pa.Array) -> np.ndarray:
    """Byte lengths of a binary/string array without nulls."""
    return pc.binary_length(arr).to_numpy().astype(np.int64)


def _proto_values(pieces: Pieces, a: AttributeValues) -> tuple[list[np.ndarray], np.ndarray]:
    """Pool one attribute's ``Span.attributes`` fields (tag 9, KeyValue{key, AnyValue}).

    Returns the piece ids of each value (one list entry per piece of a value) and the bytes per value.
    """
    m = len(a.rows)
    key = a.key.encode()
    # KeyValue.key (1, LEN) then the tag of KeyValue.value (2, LEN); the AnyValue length follows.
    key_part = b"\x0a" + varint(len(key)) + key + b"\x12"
    if a.kind == "double":
        body = key_part + b"\x09\x21"  # AnyValue of 9 bytes: double_value (4, I64) + 8 bytes
        prefix = b"\x4a" + varint(len(body) + 8) + body
        part = build_rows(m, [prefix, u64_le_matrix(a.values)])
        return [pieces.array(part)], np.full(m, len(prefix) + 8, dtype=np.int64)
    if a.kind == "bool":
        fields = []
        for flag in (b"\x00", b"\x01"):
            body = key_part + b"\x02\x10" + flag  # AnyValue of 2 bytes: bool_value (2, VARINT)
            fields.append(b"\x4a" + varint(len(body)) + body)
        ids = np.where(a.values, pieces.const(fields[1]), pieces.const(fields[0]))
        return [ids.astype(np.int64)], np.full(m, len(fields[0]), dtype=np.int64)
    if a.kind == "int":
        # The KeyValue framing depends only on the value's varint length: one constant per length.
        value = Varint(a.values.view(np.uint64))  # two's complement, as protobuf int64
        heads = np.zeros(11, dtype=np.int64)
        head_len = np.zeros(11, dtype=np.int64)
        for length in np.flatnonzero(np.bincount(value.lengths, minlength=11)).tolist():
            body = key_part + varint(1 + length) + b"\x18"  # AnyValue: int_value (3, VARINT) tag + varint
            head = b"\x4a" + varint(len(body) + length) + body
            heads[length] = pieces.const(head)
            head_len[length] = len(head)
        return [heads[value.lengths], pieces.array(varint_array(value))], head_len[value.lengths] + value.lengths
    # Strings: the framing depends only on the byte length, and lengths repeat: one constant each.
    slen = _lengths(a.values)
    heads = np.zeros(int(slen.max(initial=0)) + 1, dtype=np.int64)
    head_len = np.zeros(len(heads), dtype=np.int64)
    for length in np.flatnonzero(np.bincount(slen)).tolist():
        any_value = b"\x0a" + varint(length)  # AnyValue: string_value (1, LEN) tag + length, then bytes
        body = key_part + varint(len(any_value) + length) + any_value
        head = b"\x4a" + varint(len(body) + length) + body
        heads[length] = pieces.const(head)
        head_len[length] = len(head)
    return [heads[slen], pieces.array(a.values.cast(LB))], head_len[slen] + slen


def proto_span_fragments(chunk: pa.Table) -> pa.Array:
    """One ``ScopeSpans.spans`` field (tag 2, length, Span) per row.

    Span fields go out as trace_id, span_id, parent_span_id, kind, start, end, name, attributes:
    protobuf parsers accept fields in any order, and this one puts every fixed-width field and the
    name's length into a single header piece per span.
    """
    n = chunk.num_rows
    pieces = Pieces(n)
    attrs = attribute_values(chunk)
    counts, slot_first = attribute_slots(n, attrs)
    total = int(slot_first[-1])
    npieces = np.empty(total, dtype=np.int64)
    attr_bytes = np.zeros(n, dtype=np.int64)
    per_attr = []
    for a in attrs:
        ids, nbytes = _proto_values(pieces, a)
        slot = a.take(slot_first) + a.ranks
        npieces[slot] = len(ids)
        if a.dense:
            attr_bytes[: len(a.rows)] += nbytes
        else:
            attr_bytes[a.rows] += nbytes  # rows are unique within a column
        per_attr.append((a, ids, slot))

    name = column_array(chunk, "name")
    name_len = _lengths(name)
    tid = id_matrix(column_array(chunk, "trace_id"), 16)
    sid = u64_be_matrix(column_array(chunk, "span_id").to_numpy())
    parent_ids = column_array(chunk, "parent_span_id").to_numpy()
    start = u64_le_matrix(column_array(chunk, "start_ns").to_numpy())
    end = u64_le_matrix(column_array(chunk, "end_ns").to_numpy())
    # kind (6, VARINT), start_time_unix_nano (7, I64), end_time_unix_nano (8, I64), then name's tag (5, LEN)
    head = np.empty(n, dtype=np.int64)
    kids = parent_ids != 0
    for sel, parent_part in ((~kids, []), (kids, [b"\x22\x08", u64_be_matrix(parent_ids[kids])])):
        rows = np.flatnonzero(sel)
        if not len(rows):
            continue
        fields = [b"\x0a\x10", tid[rows], b"\x12\x08", sid[rows], *parent_part, bytes([0x30, SPAN_KIND_INTERNAL, 0x39]), start[rows], b"\x41", end[rows], b"\x2a"]
        fixed = 2 + 16 + 2 + 8 + (10 if parent_part else 0) + 3 + 8 + 1 + 8 + 1
        nv = Varint(name_len[rows])
        body_len = fixed + nv.lengths + name_len[rows] + attr_bytes[rows]
        head[rows] = pieces.array(build_rows(len(rows), [b"\x12", Varint(body_len), *fields, nv]))
    pieces.per_row(head)
    pieces.per_row(pieces.array(name.cast(LB)))

    if attrs:
        # Rank of each value's first piece within its row: strings take two pieces, others one.
        cum = np.zeros(total + 1, dtype=np.int64)
        np.cumsum(npieces, out=cum[1:])
        row_major = np.empty(int(cum[-1]), dtype=np.int64)
        for a, ids, slot in per_attr:
            first_piece = cum[slot]
            for j, piece_ids in enumerate(ids):
                row_major[first_piece + j] = piece_ids
        pieces.per_row_major(cum[slot_first[1:]] - cum[slot_first[:-1]], row_major)
    return pieces.build()


def any_value_proto(value: Any) -> AnyValue | None:
    """AnyValue message for a Python resource attribute value (None: not representable, skip)."""
    import math

    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        return AnyValue(bool_value=bool(value))
    if isinstance(value, (int, np.integer)):
        return AnyValue(int_value=int(value))
    if isinstance(value, (float, np.floating)):
        return AnyValue(double_value=float(value)) if math.isfinite(value) else None
    if isinstance(value, str):
        return AnyValue(string_value=value)
    if isinstance(value, (bytes, bytearray)):
        return AnyValue(bytes_value=bytes(value))
    if isinstance(value, (list, tuple)):
        out = AnyValue()
        out.array_value.SetInParent()
        for x in value:
            v = any_value_proto(x)
            if v is not None:
                out.array_value.values.append(v)
        return out
    if isinstance(value, dict):
        out = AnyValue()
        out.kvlist_value.SetInParent()
        for k, x in value.items():
            v = any_value_proto(x)
            if v is not None:
                out.kvlist_value.values.append(KeyValue(key=str(k), value=v))
        return out
    return AnyValue(string_value=str(value))


def _resource_bytes(attributes: dict[str, Any]) -> bytes:
    res = Resource()
    for k, v in attributes.items():
        pv = any_value_proto(v)
        if pv is not None:
            res.attributes.append(KeyValue(key=str(k), value=pv))
    return res.SerializeToString()


def _field(tag: int, payload_len: int) -> bytes:
    return bytes([tag]) + varint(payload_len)


def encode_requests(batch: SpanBatch, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES, chunk_rows: int = CHUNK_ROWS,
                    traces: list[bytes] | None = None) -> Iterator[bytes]:
    """Yield serialized ExportTraceServiceRequest messages: one per trace, split to stay <= max_bytes.

    A single span larger than ``max_bytes`` is sent alone in a request of its own (it cannot be split).
    ``traces`` gets the trace id of each request, appended before it is yielded.
    """
    layout = span_layout(batch)
    if layout.num_rows == 0:
        return
    scope = InstrumentationScope(name=SCOPE_NAME, version=package_version()).SerializeToString()
    scope_field = _field(0x0A, len(scope)) + scope  # ScopeSpans.scope (1)
    resource_fields = []
    for r in layout.resources:
        rb = _resource_bytes(r)
        resource_fields.append(_field(0x0A, len(rb)) + rb)  # ResourceSpans.resource (1)
    # Worst-case framing of a group: three length-delimited headers of at most 1 + 5 bytes each.
    group_overhead = [len(rf) + len(scope_field) + 3 * 6 for rf in resource_fields]

    groups: list[tuple[int, list[memoryview], int]] = []  # (resource index, span pieces, their bytes)
    req_size = 0
    cur_trace = -1
    cur_group = -1

    def build() -> bytes:
        out: list[bytes | memoryview] = []
        for res_idx, pieces, spans_len in groups:
            ss_len = len(scope_field) + spans_len
            rf = resource_fields[res_idx]
            rs_len = len(rf) + len(_field(0x12, ss_len)) + ss_len
            out += [_field(0x0A, rs_len), rf, _field(0x12, ss_len), scope_field]  # request.resource_spans (1)
            out += pieces
        return b"".join(out)

    for seg in iter_segments(layout, proto_span_fragments, chunk_rows):
        g = seg.group
        t = int(layout.group_trace[g])
        if t != cur_trace:
            if groups:
                if traces is not None:
                    traces.append(layout.trace_ids[cur_trace])
                yield build()
            groups, req_size, cur_trace = [], 0, t
        res_idx = int(layout.group_resource[g])
        offs = seg.offsets
        i, m = 0, len(offs) - 1
        while i < m:
            opening = g != cur_group or not groups
            extra = group_overhead[res_idx] if opening else 0
            budget = max_bytes - req_size - extra
            k = int(np.searchsorted(offs, offs[i] + budget, side="right")) - 1
            if k <= i:
                if groups:
                    if traces is not None:
                        traces.append(layout.trace_ids[cur_trace])
                    yield build()
                    groups, req_size = [], 0
                    continue
                k = i + 1  # lone oversized span
            piece = seg.data[int(offs[i]) : int(offs[k])]
            if opening:
                groups.append((res_idx, [piece], len(piece)))
                cur_group = g
            else:
                ri, pieces, size = groups[-1]
                pieces.append(piece)
                groups[-1] = (ri, pieces, size + len(piece))
            req_size += extra + len(piece)
            i = k
    if groups:
        if traces is not None:
            traces.append(layout.trace_ids[cur_trace])
        yield build()
