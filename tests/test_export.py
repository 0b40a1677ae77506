"""The export layer: OTLP/JSON lines, OTLP protobuf, OTLP over gRPC/HTTP to a real receiver, Parquet."""

from __future__ import annotations

import gc
import io
import socket
import re
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import ingested, raw_trace, trace_path  # noqa: E402
from otlp_receiver import OtlpReceiver, otlp_json_to_proto, trace_request_to_dict  # noqa: E402

from plasmient_trace import records  # noqa: E402
from plasmient_trace.conventions import SCOPE_NAME, SPAN_TABLE_SCHEMA, SpanBatch, span_table_from_columns  # noqa: E402
from plasmient_trace.export import otlp_json, otlp_proto, parquet  # noqa: E402
from plasmient_trace.pipeline import IngestOptions, ingest_paths  # noqa: E402
from plasmient_trace.stitch import ids  # noqa: E402
from plasmient_trace.export.otlp import ExportError, OtlpConfig, parse_headers, send_spans  # noqa: E402

TRACE_A = bytes.fromhex("0af7651916cd43dd8448eb211c80319c")
TRACE_B = bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736")
TRACE_C = bytes.fromhex("ffffffffffffffffffffffffffffff01")
RESOURCES = [
    {"service.name": "plasmient-trace", "host.name": "node-0", "plasmient.rank": 0, "plasmient.job.id": "job-7"},
    {"service.name": "plasmient-trace", "host.name": "node-1", "plasmient.rank": 1, "plasmient.job.id": "job-7", "plasmient.gpu.count": 8},
]


def small_batch() -> SpanBatch:
    """Three traces over two resources, roots, nulls, a NaN, awkward strings, extreme ints."""
    rows = [
        # trace, span, parent, res, name, start, end, level, step, rank, mfu, flops, op.input_dims
        (TRACE_A, 1, 0, 0, "ProfilerStep#3", 1_700_000_000_000_000_000, 1_700_000_000_500_000_000, "step", 3, 0, 0.41, 1.5e15, None),
        (TRACE_A, 2, 1, 0, "aten::mm", 1_700_000_000_100_000_000, 1_700_000_000_200_000_000, "op", 3, 0, float("nan"), 2.0e12, "[[1024, 4096], [4096, 4096]]"),
        (TRACE_A, 3, 2, 0, 'void gemm<"bf16", \\tile>(Params)', 1_700_000_000_110_000_000, 1_700_000_000_190_000_000, "kernel", 3, 0, 0.93, 2.0e12, None),
        (TRACE_B, 11, 0, 1, "ProfilerStep#4", 1_700_000_001_000_000_000, 1_700_000_001_400_000_000, "step", 4, 1, None, 0.0, None),
        (TRACE_B, 12, 11, 1, "módulo.ünïcode\u2028€", 1_700_000_001_000_000_001, 1_700_000_001_000_000_002, None, -(2**63), None, 1e-300, None, "ctl\x01\ttab"),
        (TRACE_A, 4, 1, 1, "rank-1 op in trace A", 1_700_000_000_300_000_000, 1_700_000_000_310_000_000, "op", 3, 1, float("inf"), 5e-324, None),
        (TRACE_C, 2**64 - 1, 0, 0, "", 0, 1, "fleet", 2**63 - 1, None, -0.0, 1.7976931348623157e308, None),
    ]
    cols = list(zip(*rows))
    columns = {
        "trace_id": pa.array(cols[0], pa.binary(16)),
        "span_id": pa.array(cols[1], pa.uint64()),
        "parent_span_id": pa.array(cols[2], pa.uint64()),
        "resource_index": pa.array(cols[3], pa.int32()),
        "name": pa.array(cols[4], pa.string()),
        "start_ns": pa.array(cols[5], pa.int64()),
        "end_ns": pa.array(cols[6], pa.int64()),
        "plasmient.level": pa.array(cols[7], pa.string()),
        "plasmient.step": pa.array(cols[8], pa.int64()),
        "plasmient.rank": pa.array(cols[9], pa.int64()),
        "plasmient.mfu": pa.array(cols[10], pa.float64()),
        "plasmient.flops": pa.array(cols[11], pa.float64()),
        "plasmient.op.input_dims": pa.array(cols[12], pa.string()),
    }
    return SpanBatch(span_table_from_columns(columns, len(rows)), [dict(r) for r in RESOURCES])


def big_batch(n: int = 3000, traces: int = 3, seed: int = 1) -> SpanBatch:
    """Many spans with dense attributes, for the size-limit and transport tests."""
    rng = np.random.default_rng(seed)
    trace_ids = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(traces)]
    which = np.arange(n) % traces
    columns = {
        "trace_id": pa.array([trace_ids[t] for t in which], pa.binary(16)),
        "span_id": np.arange(1, n + 1, dtype=np.uint64),
        "parent_span_id": np.where(np.arange(n) < traces, 0, (np.arange(n) % traces) + 1).astype(np.uint64),
        "resource_index": (which % 2).astype(np.int32),
        "name": pa.array([f"void kernel_{i % 97}<float, {i % 5}>(Params)" for i in range(n)], pa.string()),
        "start_ns": 1_700_000_000_000_000_000 + np.arange(n, dtype=np.int64) * 1000,
        "end_ns": 1_700_000_000_000_000_500 + np.arange(n, dtype=np.int64) * 1000,
        "plasmient.level": pa.array(["kernel"] * n),
        "plasmient.busy_s": rng.random(n),
        "plasmient.mfu": pa.array(rng.random(n), mask=rng.random(n) < 0.3),
        "plasmient.correlation_id": rng.integers(0, 2**40, n),
        "plasmient.kernel.grid": pa.array([f"{i % 64},1,1" for i in range(n)]),
    }
    return SpanBatch(span_table_from_columns(columns, n), [dict(r) for r in RESOURCES])


def canonical(batch: SpanBatch) -> pa.Table:
    """The table in a fixed row order with resource_index replaced by the resource's content."""
    table = batch.table
    res_keys = [orjson.dumps(batch.resources[i] if batch.resources else {}, option=orjson.OPT_SORT_KEYS).decode() for i in table.column("resource_index").to_pylist()]
    table = table.drop_columns(["resource_index"]).append_column("resource", pa.array(res_keys))
    return table.sort_by([("trace_id", "ascending"), ("span_id", "ascending")])


def expected_after_export(batch: SpanBatch) -> pa.Table:
    """What a reader gets back: non-finite doubles are dropped attributes (OTLP/JSON cannot hold them)."""
    table = batch.table
    for i, f in enumerate(table.schema):
        if pa.types.is_floating(f.type):
            col = table.column(i).combine_chunks()
            finite = np.isfinite(col.to_numpy(zero_copy_only=False))
            table = table.set_column(i, f, pa.array(col.to_numpy(zero_copy_only=False), f.type, mask=~finite))
    return canonical(SpanBatch(table, batch.resources))


def spans_of(requests: list[ExportTraceServiceRequest]) -> SpanBatch:
    return otlp_json.batch_from_otlp_dicts(trace_request_to_dict(r) for r in requests)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------
# OTLP/JSON lines
# --------------------------------------------------------------------------------------------


def test_jsonl_has_one_export_request_per_trace_that_protobuf_json_parses(tmp_path: Path) -> None:
    batch = small_batch()
    path = tmp_path / "traces.jsonl"
    assert otlp_json.write_jsonl(batch, path) == 3
    lines = path.read_bytes().splitlines()
    assert len(lines) == 3
    for line in lines:
        json_format.Parse(line, ExportTraceServiceRequest())  # field names, nesting and value types are valid
        doc = orjson.loads(line)
        trace_ids = {s["traceId"] for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]}
        assert len(trace_ids) == 1
    docs = [orjson.loads(line) for line in lines]
    by_trace = {d["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"]: d for d in docs}
    assert set(by_trace) == {TRACE_A.hex(), TRACE_B.hex(), TRACE_C.hex()}
    # Trace A has spans under both resources: two resourceSpans, resources[i] as resource attributes.
    trace_a = by_trace[TRACE_A.hex()]["resourceSpans"]
    assert len(trace_a) == 2
    ranks = sorted(kv["value"]["intValue"] for rs in trace_a for kv in rs["resource"]["attributes"] if kv["key"] == "plasmient.rank")
    assert ranks == ["0", "1"]
    scope = trace_a[0]["scopeSpans"][0]["scope"]
    assert scope["name"] == SCOPE_NAME and scope["version"] == otlp_json.package_version()


def test_jsonl_spans_use_otlp_json_spelling() -> None:
    doc = orjson.loads(next(iter(otlp_json.encode_jsonl_lines(small_batch()))))
    spans = {s["spanId"]: s for rs in doc["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]}
    root, mm = spans["0000000000000001"], spans["0000000000000002"]
    assert root["traceId"] == TRACE_A.hex()  # lowercase hex, not base64
    assert root.get("parentSpanId", "") == ""  # roots: omitted or empty
    assert mm["parentSpanId"] == "0000000000000001"
    assert root["kind"] == 1  # SPAN_KIND_INTERNAL as an integer
    assert root["startTimeUnixNano"] == "1700000000000000000" and root["endTimeUnixNano"] == "1700000000500000000"
    attrs = {kv["key"]: kv["value"] for kv in root["attributes"]}
    assert attrs["plasmient.level"] == {"stringValue": "step"}
    assert attrs["plasmient.step"] == {"intValue": "3"}
    assert attrs["plasmient.mfu"] == {"doubleValue": 0.41}
    assert "plasmient.op.input_dims" not in attrs  # null cell: no attribute
    mm_attrs = {kv["key"] for kv in mm["attributes"]}
    assert "plasmient.mfu" not in mm_attrs  # NaN dropped, not written as invalid JSON
    assert spans["0000000000000003"]["name"] == 'void gemm<"bf16", \\tile>(Params)'


def test_jsonl_escapes_and_extreme_values_parse_back_exactly() -> None:
    lines = list(otlp_json.encode_jsonl_lines(small_batch()))
    spans = {
        s["spanId"]: s
        for line in lines
        for rs in orjson.loads(line)["resourceSpans"]
        for ss in rs["scopeSpans"]
        for s in ss["spans"]
    }
    odd = spans[f"{12:016x}"]
    assert odd["name"] == "módulo.ünïcode\u2028€"
    attrs = {kv["key"]: kv["value"] for kv in odd["attributes"]}
    assert attrs["plasmient.op.input_dims"] == {"stringValue": "ctl\x01\ttab"}
    assert attrs["plasmient.step"] == {"intValue": str(-(2**63))}
    assert attrs["plasmient.mfu"] == {"doubleValue": 1e-300}
    last = {kv["key"]: kv["value"] for kv in spans["f" * 16]["attributes"]}
    assert last["plasmient.step"] == {"intValue": str(2**63 - 1)}
    assert last["plasmient.flops"] == {"doubleValue": 1.7976931348623157e308}
    assert spans[f"{4:016x}"]["attributes"][-1]["value"] == {"doubleValue": 5e-324}


def test_read_jsonl_round_trips_the_span_table(tmp_path: Path) -> None:
    batch = small_batch()
    path = tmp_path / "t.jsonl"
    otlp_json.write_jsonl(batch, path)
    back = otlp_json.read_jsonl(path)
    assert back.table.schema.equals(batch.table.schema)
    assert canonical(back).equals(expected_after_export(batch))
    assert sorted(back.resources, key=str) == sorted(RESOURCES, key=str)


def test_a_real_trace_read_back_in_parts_is_the_table_that_was_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The reader turns its Python values into an Arrow part every PART_SPANS spans, so a large file never
    # holds them all as Python objects. Parts of one line each must give the table read whole, and the
    # spans the stitcher wrote (the v100 trace: 6 lines of about 5,400 spans).
    from plasmient_trace.export import otlp_json_read

    batch = ingested("v100/resnet50_training.json.gz").batch
    path = tmp_path / "v100.jsonl"
    lines = otlp_json.write_jsonl(batch, path)
    assert lines == 6
    monkeypatch.setattr(otlp_json_read, "PART_SPANS", 1)
    in_parts = otlp_json.read_jsonl(path)
    assert in_parts.table.column("name").num_chunks == lines
    monkeypatch.setattr(otlp_json_read, "PART_SPANS", 10**9)
    whole = otlp_json.read_jsonl(path)
    assert whole.table.column("name").num_chunks == 1
    assert in_parts.table.equals(whole.table) and in_parts.resources == whole.resources
    assert canonical(in_parts).equals(expected_after_export(batch))
    # a bad value in a later part is still named by its line
    monkeypatch.setattr(otlp_json_read, "PART_SPANS", 1)
    good = path.read_bytes().splitlines(keepends=True)
    bad = good[3].replace(b'{"key":"plasmient.step","value":{"intValue":"', b'{"key":"plasmient.step","value":{"intValue":"x', 1)
    assert bad != good[3]
    path.write_bytes(b"".join(good[:3] + [bad]))
    with pytest.raises(ValueError, match=r"v100.jsonl:4: attribute 'plasmient.step': expected an integer, got 'x"):
        otlp_json.read_jsonl(path)


class _LinesSeeingTheGc:
    """An open span file that notes, line by line, whether the cyclic GC is on while it is read."""

    def __init__(self, lines: list[bytes]) -> None:
        self.lines, self.gc_on, self.name = lines, [], "lines"

    def __iter__(self):
        for line in self.lines:
            self.gc_on.append(gc.isenabled())
            yield line


@pytest.mark.parametrize("last_line", [b"", b"{not json\n"])
def test_reading_spans_pauses_the_cyclic_gc_and_restores_it(last_line: bytes) -> None:
    # A line of ours is a whole trace: a few hundred thousand dicts and lists that the cyclic GC would
    # rescan again and again for cycles they never have (3/4 of the parse time on the v100 trace's lines).
    lines = list(otlp_json.encode_jsonl_lines(small_batch())) + ([last_line] if last_line else [])
    source = _LinesSeeingTheGc(lines)
    assert gc.isenabled()
    try:
        otlp_json.read_jsonl(source)
    except ValueError:
        assert last_line
    assert source.gc_on == [False] * len(lines)
    assert gc.isenabled()  # restored, also after a bad line
    gc.disable()
    try:
        otlp_json.read_jsonl(_LinesSeeingTheGc(lines[:1]))
        assert not gc.isenabled()  # left as the caller had it
    finally:
        gc.enable()


def test_write_jsonl_appends_and_writes_to_open_files(tmp_path: Path) -> None:
    batch = small_batch()
    path = tmp_path / "t.jsonl"
    otlp_json.write_jsonl(batch, path)
    otlp_json.write_jsonl(batch, path, append=True)
    assert len(path.read_bytes().splitlines()) == 6
    buf = io.BytesIO()
    assert otlp_json.write_jsonl(batch, buf) == 3
    assert buf.getvalue() == b"".join(otlp_json.encode_jsonl_lines(batch))
    assert len(otlp_json.read_jsonl(path)) == 2 * len(batch)


def test_read_jsonl_reads_collector_file_exporter_lines(tmp_path: Path) -> None:
    # As the Collector's file exporter writes: flags, status, empty parentSpanId, schemaUrl, foreign attributes.
    line = {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "trainer"}}]},
                "scopeSpans": [
                    {
                        "scope": {"name": "other.lib", "version": "1.2"},
                        "spans": [
                            {
                                "traceId": TRACE_B.hex(),
                                "spanId": "00f067aa0ba902b7",
                                "parentSpanId": "",
                                "flags": 256,
                                "name": "step",
                                "kind": 1,
                                "startTimeUnixNano": "1544712660000000000",
                                "endTimeUnixNano": "1544712661000000000",
                                "attributes": [
                                    {"key": "http.method", "value": {"stringValue": "GET"}},
                                    {"key": "plasmient.step", "value": {"intValue": "12"}},
                                    {"key": "plasmient.mfu", "value": {"doubleValue": 0.5}},
                                    {"key": "plasmient.gpus", "value": {"intValue": 8}},
                                ],
                                "status": {},
                            }
                        ],
                    }
                ],
                "schemaUrl": "https://opentelemetry.io/schemas/1.4.0",
            }
        ]
    }
    path = tmp_path / "collector.jsonl"
    path.write_bytes(orjson.dumps(line) + b"\n\n" + orjson.dumps({"resourceMetrics": []}) + b"\n")
    back = otlp_json.read_jsonl(path)
    row = back.table.to_pylist()[0]
    assert len(back) == 1
    assert row["trace_id"] == TRACE_B and row["span_id"] == 0x00F067AA0BA902B7 and row["parent_span_id"] == 0
    assert row["plasmient.step"] == 12 and row["plasmient.mfu"] == 0.5 and row["plasmient.gpus"] == 8
    assert row["plasmient.level"] is None  # missing attribute: null
    assert "http.method" not in back.table.column_names  # foreign attribute: ignored
    assert back.resources == [{"service.name": "trainer"}]


@pytest.mark.parametrize(
    "content, message",
    [
        (b"{not json\n", "t.jsonl:2: not valid JSON"),
        (b'{"foo": 1}\n', "t.jsonl:2: not an OTLP ExportTraceServiceRequest"),
        (b'{"resourceSpans":[{"scopeSpans":[{"spans":[{"spanId":"0000000000000001"}]}]}]}\n', "t.jsonl:2: invalid ExportTraceServiceRequest"),
    ],
)
def test_read_jsonl_names_file_and_line_of_a_bad_line(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(next(iter(otlp_json.encode_jsonl_lines(small_batch()))) + content)
    with pytest.raises(ValueError, match=message):
        otlp_json.read_jsonl(path)


def test_read_jsonl_names_the_line_of_a_value_of_the_wrong_type(tmp_path: Path) -> None:
    good = next(iter(otlp_json.encode_jsonl_lines(small_batch())))
    bad = good.replace(b'{"intValue":"3"}', b'{"intValue":"three"}', 1)
    path = tmp_path / "t.jsonl"
    path.write_bytes(good + bad)
    with pytest.raises(ValueError, match=r"t.jsonl:2: attribute 'plasmient.step': expected an integer, got 'three'"):
        otlp_json.read_jsonl(path)


def test_protobuf_json_base64_ids_and_special_doubles_are_read() -> None:
    # json_format.MessageToDict spells ids in base64 and non-finite doubles as strings.
    request = ExportTraceServiceRequest.FromString(next(iter(otlp_proto.encode_requests(small_batch()))))
    span = request.resource_spans[0].scope_spans[0].spans[0]
    span.attributes.add(key="plasmient.busy_s").value.double_value = float("nan")
    back = otlp_json.batch_from_otlp_dicts([json_format.MessageToDict(request)])
    row = back.table.to_pylist()[0]
    assert row["trace_id"] == TRACE_A and row["span_id"] == 1 and row["plasmient.step"] == 3
    assert row["plasmient.busy_s"] is None  # NaN: absent, as the encoder treats it


def test_empty_batch_writes_nothing(tmp_path: Path) -> None:
    empty = SpanBatch(SPAN_TABLE_SCHEMA.empty_table(), [])
    assert otlp_json.write_jsonl(empty, tmp_path / "e.jsonl") == 0
    assert (tmp_path / "e.jsonl").read_bytes() == b""
    assert list(otlp_proto.encode_requests(empty)) == []
    assert len(otlp_json.read_jsonl(tmp_path / "e.jsonl")) == 0


def test_unsorted_input_is_grouped_without_losing_the_stitchers_order() -> None:
    batch = big_batch(300, traces=3)
    shuffled = batch.table.take(pa.array(np.random.default_rng(5).permutation(300)))
    lines = list(otlp_json.encode_jsonl_lines(SpanBatch(shuffled, batch.resources)))
    assert len(lines) == 3
    back = otlp_json.batch_from_otlp_dicts(orjson.loads(line) for line in lines)
    assert canonical(back).equals(expected_after_export(batch))
    # Within a (trace, resource) group the spans keep their input order.
    doc = orjson.loads(lines[0])
    ids = [int(s["spanId"], 16) for s in doc["resourceSpans"][0]["scopeSpans"][0]["spans"]]
    order = {int(v): i for i, v in enumerate(shuffled.column("span_id").to_pylist())}
    assert [order[i] for i in ids] == sorted(order[i] for i in ids)


@pytest.mark.parametrize("name", ["mi250/minitoy_train.json.gz", "v100/resnet50_training.json.gz"])
def test_a_files_lines_follow_the_steps_of_the_trace(name: str) -> None:
    # they came out in trace-id order (a hash): mi250's step 2 was the first line, and a pool's file
    # differed from one process's by its line order
    raw = raw_trace(name)
    profiler_steps = sorted((e["ts"], e["name"]) for e in raw["traceEvents"]
                            if str(e.get("name", "")).startswith("ProfilerStep#") and e.get("ph") == "X")
    expected = list(dict.fromkeys(int(step.split("#")[1]) for _, step in profiler_steps))
    job = "minitoy_train"  # a job id whose trace ids do not sort as its steps (asserted below)
    assert sorted(expected, key=lambda step: ids.trace_id(job, step)) != expected
    batch = ingest_paths([trace_path(name)], IngestOptions(job_id=job)).batch
    lines = list(otlp_json.encode_jsonl_lines(batch))
    steps = [int(re.search(rb'"name":"fleet step (\d+)"', line).group(1)) for line in lines]
    assert steps == expected and len(steps) >= 2


def test_extra_bool_and_narrow_int_columns_are_exported() -> None:
    batch = small_batch()
    table = batch.table.append_column("test.flag", pa.array([True, False, None, True, False, True, None]))
    table = table.append_column("test.small", pa.array([1, 2, 3, 4, 5, 6, 7], pa.int8()))
    lines = list(otlp_json.encode_jsonl_lines(SpanBatch(table, batch.resources)))
    spans = {s["spanId"]: s for line in lines for rs in orjson.loads(line)["resourceSpans"] for ss in rs["scopeSpans"] for s in ss["spans"]}
    root = {kv["key"]: kv["value"] for kv in spans["0000000000000001"]["attributes"]}
    assert root["test.flag"] == {"boolValue": True} and root["test.small"] == {"intValue": "1"}
    assert "test.flag" not in {kv["key"] for kv in spans["0000000000000003"]["attributes"]}


# --------------------------------------------------------------------------------------------
# OTLP protobuf
# --------------------------------------------------------------------------------------------


def test_protobuf_requests_mean_the_same_as_the_json_lines() -> None:
    batch = small_batch()
    table = batch.table.append_column("test.flag", pa.array([True, False, None, True, False, True, None]))
    batch = SpanBatch(table, batch.resources)
    protos = [ExportTraceServiceRequest.FromString(b) for b in otlp_proto.encode_requests(batch)]
    jsons = [otlp_json_to_proto(line, ExportTraceServiceRequest) for line in otlp_json.encode_jsonl_lines(batch)]
    assert len(protos) == len(jsons) == 3
    assert [json_format.MessageToDict(p) for p in protos] == [json_format.MessageToDict(j) for j in jsons]
    root = protos[0].resource_spans[0].scope_spans[0].spans[0]
    assert root.trace_id == TRACE_A and root.span_id == (1).to_bytes(8, "big") and root.parent_span_id == b""
    assert root.kind == 1 and root.start_time_unix_nano == 1_700_000_000_000_000_000


def test_protobuf_round_trips_the_span_table() -> None:
    batch = big_batch(2000)
    back = spans_of([ExportTraceServiceRequest.FromString(b) for b in otlp_proto.encode_requests(batch)])
    assert canonical(back).equals(expected_after_export(batch))


def test_requests_are_split_to_stay_under_the_byte_limit() -> None:
    batch = big_batch(3000, traces=3)
    whole = list(otlp_proto.encode_requests(batch))
    assert len(whole) == 3  # one request per trace by default
    limit = 40_000
    split = list(otlp_proto.encode_requests(batch, max_bytes=limit))
    assert len(split) > 3
    assert all(len(b) <= limit for b in split)
    requests = [ExportTraceServiceRequest.FromString(b) for b in split]
    for req in requests:
        assert len({s.trace_id for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans}) == 1
    assert canonical(spans_of(requests)).equals(expected_after_export(batch))


def test_a_span_larger_than_the_limit_goes_alone() -> None:
    batch = small_batch()
    requests = [ExportTraceServiceRequest.FromString(b) for b in otlp_proto.encode_requests(batch, max_bytes=64)]
    assert len(requests) == len(batch)
    assert all(sum(len(ss.spans) for rs in r.resource_spans for ss in rs.scope_spans) == 1 for r in requests)


def test_json_lines_can_be_split_at_a_byte_limit_too() -> None:
    batch = big_batch(3000, traces=3)
    limit = 50_000
    lines = list(otlp_json.encode_jsonl_lines(batch, max_bytes=limit))
    assert len(lines) > 3
    assert all(len(line.rstrip(b"\n")) <= limit for line in lines)
    back = otlp_json.batch_from_otlp_dicts(orjson.loads(line) for line in lines)
    assert canonical(back).equals(expected_after_export(batch))


def test_chunk_boundaries_do_not_change_the_output() -> None:
    batch = big_batch(300, traces=2)
    pieces = lambda rows: b"".join(p for p in otlp_json._json_pieces(batch, None, chunk_rows=rows) if p is not None)  # noqa: E731
    assert pieces(7) == pieces(1 << 14)
    small = list(otlp_proto.encode_requests(batch, chunk_rows=13))
    assert [ExportTraceServiceRequest.FromString(b) for b in small] == [ExportTraceServiceRequest.FromString(b) for b in otlp_proto.encode_requests(batch)]


# --------------------------------------------------------------------------------------------
# OTLP transport against a real receiver
# --------------------------------------------------------------------------------------------


@pytest.fixture
def receiver():
    with OtlpReceiver() as rx:
        yield rx


class CountingProxy:
    """TCP forwarder to a target port that counts the bytes the client sends (to see compression)."""

    def __init__(self, target_port: int) -> None:
        import threading

        self.target_port = target_port
        self.upstream_bytes = 0
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self.port = self._listener.getsockname()[1]
        self._threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            for src, dst, count in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pipe, args=(src, dst, count), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(65536):
                if count:
                    self.upstream_bytes += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._listener.close()


@pytest.mark.parametrize("compression", [None, "gzip"])
def test_grpc_export_delivers_every_span(receiver: OtlpReceiver, compression: str | None) -> None:
    batch = big_batch(3000)
    proxy = CountingProxy(receiver.grpc_port)
    try:
        config = OtlpConfig.from_env({}, endpoint=f"http://127.0.0.1:{proxy.port}", protocol="grpc", compression=compression or "none", headers="x-tenant=team%20a")
        stats = send_spans(batch, config)
    finally:
        proxy.close()
    assert stats.requests == 3 and stats.spans == 3000 and stats.retries == 0 and stats.rejected == 0
    assert canonical(spans_of(receiver.traces)).equals(expected_after_export(batch))
    got = receiver.received[0]
    assert got.transport == "grpc" and got.headers["x-tenant"] == "team a"
    # What crossed the wire: the serialized requests, or (gzip) well under half of them.
    if compression:
        assert proxy.upstream_bytes < stats.bytes / 2
    else:
        assert proxy.upstream_bytes > stats.bytes


@pytest.mark.parametrize("protocol", ["http/protobuf", "http/json"])
@pytest.mark.parametrize("compression", [None, "gzip"])
def test_http_export_delivers_every_span(receiver: OtlpReceiver, protocol: str, compression: str | None) -> None:
    batch = big_batch(2000)
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol,
        "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer%20t0ken",
    }
    if compression:
        env["OTEL_EXPORTER_OTLP_COMPRESSION"] = compression
    stats = send_spans(batch, OtlpConfig.from_env(env))
    assert stats.requests == 3
    assert canonical(spans_of(receiver.traces)).equals(expected_after_export(batch))
    got = receiver.received[0]
    assert got.path == "/v1/traces"
    assert got.content_type == ("application/json" if protocol == "http/json" else "application/x-protobuf")
    assert got.content_encoding == (compression or "")
    assert got.headers["authorization"] == "Bearer t0ken"
    if compression:
        assert stats.bytes_sent < stats.bytes


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_retryable_failures_are_retried(receiver: OtlpReceiver, protocol: str) -> None:
    receiver.fail_next(2, http_status=503)
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    config = OtlpConfig.from_env({}, endpoint=endpoint, protocol=protocol, retry_initial_s=0.05, timeout_s=10)
    stats = send_spans(small_batch(), config)
    assert stats.retries == 2 and stats.requests == 3
    assert receiver.span_count() == len(small_batch())


def test_http_429_honours_retry_after(receiver: OtlpReceiver) -> None:
    receiver.fail_next(1, http_status=429, retry_after="0.3")
    config = OtlpConfig.from_env({}, endpoint=receiver.http_endpoint, protocol="http/protobuf", retry_initial_s=0.01)
    start = time.monotonic()
    stats = send_spans(small_batch(), config)
    assert stats.retries == 1
    assert time.monotonic() - start >= 0.3


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_non_retryable_failure_raises_at_once(receiver: OtlpReceiver, protocol: str) -> None:
    import grpc

    receiver.fail_next(5, grpc_code=grpc.StatusCode.INVALID_ARGUMENT, http_status=400)
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    config = OtlpConfig.from_env({}, endpoint=endpoint, protocol=protocol, timeout_s=10)
    with pytest.raises(ExportError, match="INVALID_ARGUMENT|HTTP 400") as err:
        send_spans(small_batch(), config)
    assert "1 attempt " in str(err.value)  # no retry: the count says it, not a clock on a loaded machine


def test_a_generic_endpoint_ending_in_v1_traces_fails_with_what_to_change(receiver: OtlpReceiver) -> None:
    # the spec appends /v1/traces to OTEL_EXPORTER_OTLP_ENDPOINT whatever its path: a signal URL there
    # doubles it, and the collector answers 404 (here, the receiver, on any path it does not serve)
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint.rstrip("/") + "/v1/traces",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TIMEOUT": "10000"}
    with pytest.raises(ExportError) as err:
        send_spans(small_batch(), OtlpConfig.from_env(env))
    assert "/v1/traces/v1/traces" in str(err.value) and "HTTP 404" in str(err.value)
    assert "drop the /v1/... from it, or give the full URL as OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" in str(err.value)
    # the same URL as the signal's own endpoint is used as is, and works
    stats = send_spans(small_batch(), OtlpConfig.from_env({**env, "OTEL_EXPORTER_OTLP_ENDPOINT": "",
                                                           "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": env["OTEL_EXPORTER_OTLP_ENDPOINT"]}))
    assert stats.spans == len(small_batch())
    receiver.fail_next(1, http_status=404)  # a 404 for another reason carries no such hint
    with pytest.raises(ExportError) as other:
        send_spans(small_batch(), OtlpConfig.from_env({}, endpoint=receiver.http_endpoint, protocol="http/protobuf"))
    assert "HTTP 404" in str(other.value) and "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT" not in str(other.value)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf", "http/json"])
def test_the_other_transports_port_fails_at_once_saying_which_protocol_to_set(receiver: OtlpReceiver, protocol: str) -> None:
    # the Collector takes gRPC on 4317 and HTTP on 4318: the two are easily swapped, and retrying never helps
    other = receiver.http_endpoint if protocol == "grpc" else receiver.grpc_endpoint
    with pytest.raises(ExportError) as err:
        send_spans(small_batch(), OtlpConfig.from_env({}, endpoint=other, protocol=protocol, timeout_s=10))
    text = str(err.value)
    assert "1 attempt " in text and text.isprintable()  # no retries, and none of the peer's binary bytes
    want = "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf" if protocol == "grpc" else "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"
    assert want in text, text
    assert receiver.span_count() == 0


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A private CA and a certificate it signed for 127.0.0.1, made with the openssl command."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test CA with")
    d = tmp_path_factory.mktemp("tls")
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for cmd in (
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=plasmient-test-CA",
        "req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1",
        "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile san.cnf",
    ):
        subprocess.run(["openssl", *cmd.split()], cwd=d, check=True, capture_output=True, timeout=60)
    return {name: d / f"{name}.pem" if name != "key" else d / "server.key" for name in ("ca", "server", "key")}


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf", "http/json"])
def test_tls_export_trusts_the_ca_it_is_given_and_no_other(tls_files: dict[str, Path], protocol: str) -> None:
    with OtlpReceiver(tls=(tls_files["server"], tls_files["key"])) as rx:
        endpoint = rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint
        assert endpoint.startswith("https://")
        env = {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(tls_files["ca"])}
        stats = send_spans(small_batch(), OtlpConfig.from_env(env, endpoint=endpoint, protocol=protocol, timeout_s=10))
        assert stats.spans == rx.span_count() == len(small_batch())
        # the system's trust store does not know this CA: refused, not sent in the clear, not retried
        with pytest.raises(ExportError) as err:
            send_spans(small_batch(), OtlpConfig.from_env({}, endpoint=endpoint, protocol=protocol, timeout_s=10))
        assert "1 attempt " in str(err.value) and "set OTEL_EXPORTER_OTLP_CERTIFICATE" in str(err.value), str(err.value)
        assert rx.span_count() == len(small_batch())


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_https_to_a_port_without_tls_fails_at_once_saying_so(receiver: OtlpReceiver, protocol: str) -> None:
    endpoint = (receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint).replace("http://", "https://")
    with pytest.raises(ExportError) as err:
        send_spans(small_batch(), OtlpConfig.from_env({}, endpoint=endpoint, protocol=protocol, timeout_s=10))
    assert "1 attempt " in str(err.value) and "does not speak TLS: name it with http://" in str(err.value), str(err.value)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf", "http/json"])
def test_http_to_a_tls_port_fails_at_once_saying_to_name_it_https(tls_files: dict[str, Path], protocol: str) -> None:
    # A TLS port drops a plain request without a word (a reset, a closed socket), as a collector that is
    # down does: it was retried for the whole timeout, then reported as "Connection reset by peer".
    with OtlpReceiver(tls=(tls_files["server"], tls_files["key"])) as rx:
        endpoint = (rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint).replace("https://", "http://")
        with pytest.raises(ExportError) as err:
            send_spans(small_batch(), OtlpConfig.from_env({}, endpoint=endpoint, protocol=protocol, timeout_s=10))
        text = str(err.value)
        assert "1 attempt " in text and "the endpoint speaks TLS: name it with https://, not http://" in text, text
        if protocol == "grpc":  # a bare host:port with OTEL_EXPORTER_OTLP_INSECURE=true is the same mistake
            bare = endpoint.removeprefix("http://")
            env = {"OTEL_EXPORTER_OTLP_INSECURE": "true"}
            with pytest.raises(ExportError) as err:
                send_spans(small_batch(), OtlpConfig.from_env(env, endpoint=bare, protocol=protocol, timeout_s=10))
            assert "1 attempt " in str(err.value) and "unset OTEL_EXPORTER_OTLP_INSECURE" in str(err.value), str(err.value)
        assert rx.span_count() == 0


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_plain_port_that_resets_connections_is_retried_not_called_tls(protocol: str) -> None:
    # A collector being restarted resets connections too; it does not complete a TLS handshake, so it is
    # an outage, retried until the deadline, and no hint about https:// is given.
    import threading

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    stop = threading.Event()

    def reset_every_connection() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.recv(1)  # the first bytes of the request (or of the ClientHello), then an abortive close
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            conn.close()

    thread = threading.Thread(target=reset_every_connection, daemon=True)
    thread.start()
    try:
        config = OtlpConfig.from_env({}, endpoint=f"http://127.0.0.1:{port}", protocol=protocol, timeout_s=3,
                                     retry_initial_s=0.05)
        with pytest.raises(ExportError) as err:
            send_spans(small_batch(), config)
    finally:
        stop.set()
        thread.join()
        server.close()
    text = str(err.value)
    assert "1 attempt " not in text and "TLS" not in text, text


def test_a_refused_tls_handshake_leaves_one_line_in_stderr_not_grpcs_logs(tls_files: dict[str, Path], tmp_path: Path) -> None:
    # gRPC's core logged every failed handshake at INFO into the process's stderr (a traced job's, live)
    import os
    import subprocess

    from conftest import trace_path

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "GRPC_"))}
    with OtlpReceiver(tls=(tls_files["server"], tls_files["key"])) as rx:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = rx.grpc_endpoint
        proc = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "ingest",
                               str(trace_path("h100/vit_image_classification.json.gz")), "--quiet"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "set OTEL_EXPORTER_OTLP_CERTIFICATE" in lines[0], proc.stderr


def test_partial_success_is_counted_not_raised(receiver: OtlpReceiver) -> None:
    receiver.reject_next(1, rejected=2, message="span too old")
    stats = send_spans(small_batch(), OtlpConfig.from_env({}, endpoint=receiver.grpc_endpoint))
    assert stats.rejected == 2 and stats.messages == ["span too old"]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf", "http/json"])
def test_dead_endpoint_raises_one_clear_line_within_the_timeout(protocol: str) -> None:
    port = free_port()  # nothing listens there
    config = OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": "1500"}, endpoint=f"http://127.0.0.1:{port}", protocol=protocol, retry_initial_s=0.1)
    assert config.timeout_s == 1.5
    start = time.monotonic()
    with pytest.raises(ExportError) as err:
        send_spans(small_batch(), config)
    elapsed = time.monotonic() - start
    assert elapsed < 30  # bounded by the 1.5 s timeout (generous for a loaded machine), not by gRPC's own backoff
    message = str(err.value)
    assert "\n" not in message
    assert f"127.0.0.1:{port}" in message and f"({protocol})" in message
    assert "attempts" in message


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_collector_that_never_answers_costs_at_most_the_timeout(receiver: OtlpReceiver, protocol: str) -> None:
    receiver.delay_s = 15.0  # answers only after 15 s
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    config = OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_TIMEOUT": "800"}, endpoint=endpoint, protocol=protocol)
    start = time.monotonic()
    with pytest.raises(ExportError, match="DEADLINE_EXCEEDED|timed out"):
        send_spans(small_batch(), config)
    assert time.monotonic() - start < 10  # ended by the 0.8 s deadline, long before the answer


def test_a_collector_that_comes_back_receives_the_rest(receiver: OtlpReceiver) -> None:
    receiver.stop()
    import threading

    threading.Timer(0.6, receiver.start).start()  # back on the same port while the exporter retries
    config = OtlpConfig.from_env({}, endpoint=receiver.grpc_endpoint, retry_initial_s=0.1, timeout_s=60)
    stats = send_spans(small_batch(), config)
    assert stats.retries >= 1
    assert receiver.wait_for(requests=3, timeout=120)


def test_receiver_restarts_on_the_same_ports(receiver: OtlpReceiver) -> None:
    grpc_port, http_port = receiver.grpc_port, receiver.http_port
    send_spans(small_batch(), OtlpConfig.from_env({}, endpoint=receiver.http_endpoint, protocol="http/protobuf"))
    receiver.stop()
    with pytest.raises(ExportError):
        send_spans(small_batch(), OtlpConfig.from_env({}, endpoint=receiver.http_endpoint, protocol="http/protobuf", timeout_s=0.5))
    receiver.start()
    assert (receiver.grpc_port, receiver.http_port) == (grpc_port, http_port)
    send_spans(small_batch(), OtlpConfig.from_env({}, endpoint=receiver.grpc_endpoint))
    assert len(receiver.traces) == 6


def test_receiver_accepts_metrics_over_both_transports(receiver: OtlpReceiver) -> None:
    import urllib.request

    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2

    from plasmient_trace.export.otlp import OtlpClient

    req = metrics_service_pb2.ExportMetricsServiceRequest()
    metric = req.resource_metrics.add().scope_metrics.add().metrics.add()
    metric.name = "plasmient.step.mfu"
    point = metric.gauge.data_points.add()
    point.as_double = 0.37
    exemplar = point.exemplars.add()
    exemplar.trace_id = TRACE_A
    exemplar.span_id = (1).to_bytes(8, "big")
    with OtlpClient(OtlpConfig.from_env({}, endpoint=receiver.grpc_endpoint).for_signal("metrics", {})) as client:
        client.export(req.SerializeToString())
    doc = json_format.MessageToDict(req)
    exemplar_json = doc["resourceMetrics"][0]["scopeMetrics"][0]["metrics"][0]["gauge"]["dataPoints"][0]["exemplars"][0]
    exemplar_json["traceId"], exemplar_json["spanId"] = TRACE_A.hex(), f"{1:016x}"  # OTLP/JSON: hex ids
    http_req = urllib.request.Request(f"{receiver.http_endpoint}/v1/metrics", data=orjson.dumps(doc), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(http_req, timeout=5) as resp:
        assert resp.status == 200
    assert receiver.wait_for(requests=2, signal="metrics", timeout=120)
    assert [m.resource_metrics[0].scope_metrics[0].metrics[0].gauge.data_points[0].exemplars[0].trace_id for m in receiver.metrics] == [TRACE_A, TRACE_A]


# --------------------------------------------------------------------------------------------
# Configuration from the environment (OTLP exporter spec)
# --------------------------------------------------------------------------------------------


def test_defaults_are_grpc_to_localhost() -> None:
    config = OtlpConfig.from_env({})
    assert (config.protocol, config.endpoint, config.timeout_s, config.compression, config.explicit) == ("grpc", "http://localhost:4317", 10.0, None, False)
    http = OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert http.endpoint == "http://localhost:4318/v1/traces"


@pytest.mark.parametrize(
    "generic, expected",
    [
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://gw.example.com/otlp", "https://gw.example.com/otlp/v1/traces"),
    ],
)
def test_generic_http_endpoint_gets_the_signal_path(generic: str, expected: str) -> None:
    config = OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": generic, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert config.endpoint == expected and config.explicit
    assert config.for_signal("metrics", {}).endpoint == expected.replace("/v1/traces", "/v1/metrics")


def test_signal_endpoint_is_used_as_is_and_wins() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://generic:4318",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:9999/custom/path",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
    }
    assert OtlpConfig.from_env(env).endpoint == "http://traces:9999/custom/path"
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://traces:9999"
    assert OtlpConfig.from_env(env).endpoint == "http://traces:9999/"  # no path: the root path
    assert OtlpConfig.from_env(env, endpoint="http://arg:4318").endpoint == "http://arg:4318/v1/traces"  # argument beats env


def test_signal_specific_settings_override_generic_ones() -> None:
    env = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_HEADERS": "a=1",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "b=2",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "30000",
        "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "250",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "none",
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }
    config = OtlpConfig.from_env(env)
    assert config.protocol == "grpc" and config.endpoint == "collector:4317"
    assert config.headers == {"b": "2"} and config.timeout_s == 0.25 and config.compression == "gzip" and config.insecure
    # (over HTTP the endpoint needs its scheme: "collector:4317" is refused as a setting, as the client refused it)
    assert OtlpConfig.from_env(env, protocol="http/protobuf", endpoint="http://collector:4318", timeout_s=3,
                               headers={"X-A": "b"}).headers == {"x-a": "b"}


def test_headers_are_parsed_per_spec() -> None:
    assert parse_headers("api-key=a%20b%2Cc, X-Tenant = t1 ,bad,=novalue,k=v=w") == {"api-key": "a b,c", "x-tenant": "t1", "k": "v=w"}


@pytest.mark.parametrize(
    "env, match",
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "thrift"}, "OTEL_EXPORTER_OTLP_PROTOCOL='thrift'"),
        ({"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "soon"}, "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT"),
        ({"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"}, "compression 'zstd'"),
        ({"OTEL_EXPORTER_OTLP_INSECURE": "maybe"}, "OTEL_EXPORTER_OTLP_INSECURE"),
    ],
)
def test_invalid_settings_are_rejected_with_the_variable_named(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OtlpConfig.from_env(env)


def test_tls_files_that_are_missing_or_not_pem_are_named_before_any_export(tmp_path: Path, capsys, monkeypatch) -> None:
    # they used to fail every export alike, after the work: '[Errno 2] No such file ...' with no variable,
    # or an SSLError retried five times
    pem = tmp_path / "ca.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    text = tmp_path / "notes.txt"
    text.write_text("not a certificate\n")
    missing = tmp_path / "nope.pem"
    assert OtlpConfig.from_env({"OTEL_EXPORTER_OTLP_CERTIFICATE": str(pem)}).certificate == str(pem)
    for var in ("OTEL_EXPORTER_OTLP_CERTIFICATE", "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE"):
        with pytest.raises(ValueError, match=re.escape(f"{var}='{missing}': No such file or directory")):
            OtlpConfig.from_env({var: str(missing)})
        with pytest.raises(ValueError, match=re.escape(f"{var}='{text}': not a PEM file")):
            OtlpConfig.from_env({var: str(text)})
    with pytest.raises(ValueError, match=re.escape(f"certificate argument='{missing}'")):
        OtlpConfig.from_env({}, certificate=str(missing))
    from conftest import trace_path

    from plasmient_trace.cli import main as cli_main

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "https://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(missing))
    monkeypatch.chdir(tmp_path)  # a spill directory, had it got that far, lands here
    assert cli_main(["ingest", str(trace_path("h100/vit_image_classification.json.gz")), "--quiet"]) == 2
    assert not (tmp_path / "plasmient-spill").exists()
    assert capsys.readouterr().err.strip().splitlines() == [
        f"plasmient: error: OTEL_EXPORTER_OTLP_CERTIFICATE='{missing}': No such file or directory"]


# --------------------------------------------------------------------------------------------
# Parquet
# --------------------------------------------------------------------------------------------


def _record_set(rank: int, kernels: int) -> records.RecordSet:
    rs = records.RecordSet(source=f"rank-{rank}.json.gz", resource={"plasmient.rank": rank, "host.name": f"node-{rank}"})
    rs.kernels = records.table_from_columns(
        "kernels",
        {
            "device": [0] * kernels,
            "start_ns": list(range(kernels)),
            "end_ns": [i + 10 for i in range(kernels)],
            "name": [f"k{i}" for i in range(kernels)],
            "kind": ["kernel"] * kernels,
            "grid": [[128, 1, 1]] * kernels,
            "block": [[256, 1, 1]] * kernels,
        },
    )
    rs.steps = records.table_from_columns("steps", {"step": [3], "start_ns": [0], "end_ns": [100], "name": ["ProfilerStep#3"]})
    return rs


def test_parquet_writes_every_table_readable_with_row_counts(tmp_path: Path) -> None:
    batch = small_batch()
    files = parquet.write_parquet([_record_set(0, 5), _record_set(1, 3)], batch, tmp_path / "pq")
    names = {f.name for f in files}
    assert names == {f"{t}.parquet" for t in records.TABLE_SCHEMAS} | {"spans.parquet", "resources.parquet"}
    kernels = pq.read_table(tmp_path / "pq" / "kernels.parquet")
    assert kernels.num_rows == 8
    assert kernels.column("rank").to_pylist() == [0] * 5 + [1] * 3
    assert kernels.column("source").to_pylist()[-1] == "rank-1.json.gz"
    assert kernels.column("grid").to_pylist()[0] == [128, 1, 1]
    samples = pq.read_table(tmp_path / "pq" / "samples.parquet")  # zero rows, schema kept
    assert samples.num_rows == 0 and samples.column_names == records.SAMPLES.names + ["rank", "source"]
    spans = pq.read_table(tmp_path / "pq" / "spans.parquet")
    assert spans.num_rows == len(batch)
    assert spans.schema.field("trace_id").type == pa.string()
    rows = {r["span_id"]: r for r in spans.to_pylist()}
    assert rows["0000000000000002"]["trace_id"] == TRACE_A.hex() and rows["0000000000000002"]["parent_span_id"] == "0000000000000001"
    assert rows["0000000000000001"]["parent_span_id"] is None
    assert rows["f" * 16]["trace_id"] == TRACE_C.hex()
    resources = pq.read_table(tmp_path / "pq" / "resources.parquet").to_pylist()
    assert [r["plasmient.rank"] for r in resources] == [0, 1] and resources[1]["plasmient.gpu.count"] == 8


def test_a_parquet_write_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path: Path, monkeypatch) -> None:
    import errno

    from plasmient_trace.export.sinks import OutputError

    parquet.write_parquet([], None, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def disk_full(table, where, **kwargs):
        (open(where, "wb") if isinstance(where, (str, Path)) else where).write(b"PAR1 half a file")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(parquet.pq, "write_table", disk_full)
    with pytest.raises(OutputError, match=r"kernels\.parquet: No space left on device"):
        parquet.write_parquet([], None, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_parquet_without_spans_still_writes_the_span_schema(tmp_path: Path) -> None:
    parquet.write_parquet([], None, tmp_path)
    spans = pq.read_table(tmp_path / "spans.parquet")
    assert spans.num_rows == 0 and "plasmient.mfu" in spans.column_names
    assert pq.read_table(tmp_path / "kernels.parquet").num_rows == 0


# --------------------------------------------------------------------------------------------
# A real trace, end to end
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trace", ["mi250/minitoy_train.json.gz", "h100/vit_image_classification.json.gz"])
def test_a_real_stitched_trace_survives_every_export(receiver: OtlpReceiver, tmp_path: Path, trace: str) -> None:
    from conftest import ingested

    result = ingested(trace)  # real Kineto traces (AMD MI250 training steps; H100 ViT inference), stitched
    batch = result.batch
    expected = expected_after_export(batch)

    path = tmp_path / "real.jsonl"
    assert otlp_json.write_jsonl(batch, path) == len(batch.trace_ids())
    assert canonical(otlp_json.read_jsonl(path)).equals(expected)

    protos = [ExportTraceServiceRequest.FromString(b) for b in otlp_proto.encode_requests(batch)]
    assert canonical(spans_of(protos)).equals(expected)

    stats = send_spans(batch, OtlpConfig.from_env({}, endpoint=receiver.grpc_endpoint, compression="gzip"))
    assert stats.spans == len(batch) and receiver.span_count() == len(batch)
    assert canonical(spans_of(receiver.traces)).equals(expected)

    files = {f.name: f for f in parquet.write_parquet(result.records, batch, tmp_path / "pq")}
    for name in records.TABLE_SCHEMAS:
        assert pq.read_table(files[f"{name}.parquet"]).num_rows == sum(rs.tables()[name].num_rows for rs in result.records)
    assert pq.read_table(files["spans.parquet"]).num_rows == len(batch)
