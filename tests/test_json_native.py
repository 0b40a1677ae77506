"""The native span assembler writes the bytes the numpy layout writes, on real traces and on hostile
values, however the spans are cut into chunks and parts; without a C compiler the numpy layout runs
and the reason is kept."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest
from conftest import ingested

from plasmient_trace.conventions import CORE_COLUMNS, SpanBatch
from plasmient_trace.export import json_native, otlp_json

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here")


def _both_layouts(batch: SpanBatch, monkeypatch: pytest.MonkeyPatch, **sizes: int) -> tuple[bytes, bytes]:
    def encode() -> bytes:
        return b"".join(p for p in otlp_json._json_pieces(batch, None, **sizes) if p is not None)

    assert json_native.assembler() is not None, json_native.failure()
    native = encode()
    with monkeypatch.context() as m:
        m.setenv("PLASMIENT_NATIVE_JSON", "0")
        assert json_native.assembler() is None
        numpy_bytes = encode()
    return native, numpy_bytes


@needs_cc
@pytest.mark.parametrize(("name", "max_spans", "sizes"), [
    ("mi300x/resnet_act_checkpoint_rank0_of8.json.gz", 10**7, {}),  # activation checkpointing, every kernel
    ("a100/nccl_training_rank0_of2.json.gz", None, {"chunk_rows": 997, "part_bytes": 1 << 16}),
    # parts of one span: every row goes through the too-small-buffer path once
    ("mi250/minitoy_train.json.gz", None, {"chunk_rows": 5, "part_bytes": 1}),
])
def test_native_and_numpy_layouts_write_the_same_bytes(name: str, max_spans: int | None, sizes: dict,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    native, numpy_bytes = _both_layouts(ingested(name, max_spans).batch, monkeypatch, **sizes)
    assert len(native) > 10_000 and native == numpy_bytes


def _hostile_batch() -> SpanBatch:
    n = 6
    big = "x" * 300_000  # one span far larger than a part
    core = {
        "trace_id": pa.array([bytes([1 + i // 3]) * 16 for i in range(n)], pa.binary(16)),
        "span_id": pa.array(np.arange(1, n + 1, dtype=np.uint64)),
        "parent_span_id": pa.array(np.array([0, 1, 1, 0, 4, 4], np.uint64)),
        "resource_index": pa.array(np.zeros(n, np.int32)),
        "name": pa.array(['plain', 'quote " and \\ back', "tab\there\x01", "ünï ☃", "", big]),
        "start_ns": pa.array(np.arange(n, dtype=np.int64) * 10**9),
        "end_ns": pa.array(np.arange(n, dtype=np.int64) * 10**9 + 5),
    }
    extra = {
        "s": pa.array(["a", None, 'q"q', "ctl\x1f", None, "z"], pa.string()),
        "f": pa.array([-0.0, float("nan"), None, 1e300, None, float("inf")], pa.float64()),
        "i": pa.array([None, -(2**63), 2**63 - 1, 0, None, 7], pa.int64()),
        "b": pa.array([True, None, False, True, None, None], pa.bool_()),
        "u": pa.array([2**64 - 1, None, 0, None, None, 3], pa.uint64()),
    }
    table = pa.table({f.name: core[f.name].cast(f.type) for f in CORE_COLUMNS} | extra)
    return SpanBatch(table=table, resources=[{"service.name": "s"}])


@needs_cc
@pytest.mark.parametrize("sizes", [{}, {"chunk_rows": 2, "part_bytes": 1}])
def test_hostile_values_are_laid_out_alike_and_parse(sizes: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    native, numpy_bytes = _both_layouts(_hostile_batch(), monkeypatch, **sizes)
    assert native == numpy_bytes
    spans = [s for line in native.splitlines() for rs in json.loads(line)["resourceSpans"]
             for ss in rs["scopeSpans"] for s in ss["spans"]]
    by_name = {s["name"]: s for s in spans}
    assert len(spans) == 6 and "x" * 300_000 in by_name
    assert {kv["key"]: kv["value"] for kv in by_name['quote " and \\ back']["attributes"]} == {"i": {"intValue": str(-(2**63))}}
    assert by_name["tab\there\x01"]["attributes"] == [{"key": "s", "value": {"stringValue": 'q"q'}},
                                                      {"key": "i", "value": {"intValue": str(2**63 - 1)}},
                                                      {"key": "b", "value": {"boolValue": False}},
                                                      {"key": "u", "value": {"intValue": "0"}}]
    assert "attributes" not in by_name[""]  # nothing present: no attributes key at all
    # uint64 above 2^63 wraps as the protobuf int64 varint does; non-finite doubles are absent
    assert by_name["plain"]["attributes"] == [{"key": "s", "value": {"stringValue": "a"}}, {"key": "f", "value": {"doubleValue": -0.0}},
                                              {"key": "b", "value": {"boolValue": True}}, {"key": "u", "value": {"intValue": "-1"}}]


def test_without_a_compiler_the_numpy_layout_runs_and_the_reason_is_kept(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_native, "_function", None)
    monkeypatch.setattr(json_native, "_failure", None)
    monkeypatch.setenv("PLASMIENT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.delenv("PLASMIENT_NATIVE_JSON", raising=False)
    batch = _hostile_batch()
    lines = list(otlp_json.encode_jsonl_lines(batch))
    assert json_native.assembler() is None and "no C compiler" in (json_native.failure() or "")
    assert len(lines) == 2 and all(json.loads(line) for line in lines)
    assert not (tmp_path / "cache").exists()  # nothing half-built left behind
