"""Real backends, real limits: a 33,307-span ingest of a real trace reaches receivers that refuse
requests over 4 MiB (as Jaeger, Tempo and the Collector do by default), a traces-only backend,
and a backend that answers 503 while its queue is full; the shipped Collector batch sizes are
checked against the measured size of real spans; OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER
select what is sent; --rebase-time keeps every relative time."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import numpy as np
import orjson
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from conftest import REPO, ingested, raw_trace, trace_path
from otlp_receiver import OtlpReceiver

from plasmient_trace.cli import main
from plasmient_trace.export.otlp_json import read_jsonl
from plasmient_trace.export.otlp_proto import encode_requests
from plasmient_trace.export.rebase import rebase_time

BIG = "a100/cuda_graphs_rank0_of16.json.gz"  # 33,307 spans with folding off: the trace
SIZE_TRACES = [BIG, "a100/nccl_training_rank0_of2.json.gz", "b200/eager_rank0_of8.json.gz",
               "mi300x/resnet_act_checkpoint_rank0_of8.json.gz", "h100/qwen1.5_0.5b_chat_inference.json.gz"]
DEFAULT_LIMIT = 4 * 1024 * 1024  # gRPC's and the Collector's default max receive size
UNFOLDED = 10**6  # --max-spans high enough that no kernel is folded


def _big_batch():
    return ingested(BIG, UNFOLDED).batch


def _ingest(tmp_path: Path, monkeypatch, env: dict[str, str], *extra: str) -> int:
    monkeypatch.chdir(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return main(["ingest", str(trace_path(BIG)), "--job-id", "test-job", "--max-spans", str(UNFOLDED), "--quiet", *extra])


def _arrived_ids(rx: OtlpReceiver) -> set[tuple[bytes, bytes]]:
    return {(s.trace_id, s.span_id) for req in rx.traces for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans}


def _expected_ids() -> set[tuple[bytes, bytes]]:
    t = _big_batch().table
    return {(tid, int(sid).to_bytes(8, "big")) for tid, sid in zip(t.column("trace_id").to_pylist(), t.column("span_id").to_pylist())}


def _span_sizes(batch) -> tuple[np.ndarray, int]:
    """Encoded size of every span in exporter order as the generated protobuf classes measure it
    (not our encoder), and the largest resource."""
    sizes, resource = [], 0
    for body in encode_requests(batch):
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        for rs in request.resource_spans:
            resource = max(resource, rs.resource.ByteSize())
            sizes += [s.ByteSize() for ss in rs.scope_spans for s in ss.spans]
    return np.array(sizes), resource


def _collector_batch() -> dict:
    doc = yaml.safe_load((REPO / "collector-config" / "otel-collector.yaml").read_text())
    return doc["processors"]["batch"]


# ---- 1. request sizes --------------------------------------------------------------------------


def test_the_shipped_collector_batch_fits_a_4_mib_receiver_at_the_measured_span_size() -> None:
    batch = _collector_batch()
    per_request = batch["send_batch_max_size"]
    assert 0 < batch["send_batch_size"] <= per_request
    for name in SIZE_TRACES:
        sizes, resource = _span_sizes(ingested(name, UNFOLDED).batch)
        framed = sizes + 3  # tag and length of each span inside ScopeSpans
        assert 900 < sizes.mean() < 1400, name  # ~1.2 KB: what the batch size is derived from
        overhead = resource + 200  # resource, scope and framing of one ResourceSpans
        # Even a request made only of the 0.1% largest spans stays under the default limit ...
        assert per_request * np.percentile(framed, 99.9) + overhead < DEFAULT_LIMIT, name
        # ... and the heaviest run of consecutive spans leaves 25% for attributes added later.
        window = np.convolve(framed, np.ones(min(per_request, len(framed)), dtype=np.int64), mode="valid").max()
        assert (window + overhead) * 1.25 < DEFAULT_LIMIT, name


def _rebatched_requests(per_request: int) -> list[bytes]:
    """The Collector's batch processor in miniature: the spans as received, regrouped into requests of
    ``per_request`` spans and re-encoded by the generated protobuf classes, largest spans first (the worst case)."""
    spans = []
    for body in encode_requests(_big_batch()):
        request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
        spans += [(rs.resource, s) for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans]
    spans.sort(key=lambda rs_s: -rs_s[1].ByteSize())
    out = []
    for i in range(0, len(spans), per_request):
        request = trace_service_pb2.ExportTraceServiceRequest()
        for resource, span in spans[i:i + per_request]:
            rs = request.resource_spans.add()
            rs.resource.CopyFrom(resource)
            rs.scope_spans.add().spans.append(span)
        out.append(request.SerializeToString())
    return out


def test_the_shipped_batch_size_reaches_a_4_mib_receiver_whole_and_the_old_one_did_not() -> None:
    with OtlpReceiver(max_receive_bytes=DEFAULT_LIMIT) as rx, grpc.insecure_channel(f"127.0.0.1:{rx.grpc_port}") as channel:
        stub = trace_service_pb2_grpc.TraceServiceStub(channel)
        old = _rebatched_requests(16384)
        with pytest.raises(grpc.RpcError) as err:
            stub.Export(trace_service_pb2.ExportTraceServiceRequest.FromString(old[0]), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # what the second Collector answered
        rx.clear()
        for body in _rebatched_requests(_collector_batch()["send_batch_max_size"]):
            stub.Export(trace_service_pb2.ExportTraceServiceRequest.FromString(body), timeout=60)
        assert rx.span_count() == len(_big_batch()) == 33_307


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf", "http/json"])
def test_a_33k_span_ingest_arrives_whole_at_a_receiver_that_refuses_requests_over_4_mib(protocol, tmp_path, monkeypatch, capsys) -> None:
    with OtlpReceiver(max_receive_bytes=DEFAULT_LIMIT) as rx:
        endpoint = rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint
        code = _ingest(tmp_path, monkeypatch, {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol})
        assert code == 0, capsys.readouterr().err
        assert rx.span_count() == 33_307 and _arrived_ids(rx) == _expected_ids()
        assert max(r.body_bytes for r in rx.received) <= DEFAULT_LIMIT and not rx.refused


def test_the_request_limit_is_configurable_and_the_receiver_limit_is_real(tmp_path, monkeypatch, capsys) -> None:
    with OtlpReceiver(max_receive_bytes=DEFAULT_LIMIT) as rx:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.http_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "PLASMIENT_OTLP_MAX_REQUEST_MIB": "8"}
        code = _ingest(tmp_path, monkeypatch, env)
        err = capsys.readouterr().err
        assert code == 1 and "HTTP 413" in err and "failed for traces:" in err and "PLASMIENT_OTLP_MAX_REQUEST_MIB" in err
        assert rx.refused and all(r.startswith("traces: ") for r in rx.refused)
        rx.clear()
        rx.refused.clear()
        monkeypatch.setenv("PLASMIENT_OTLP_MAX_REQUEST_MIB", "1")
        assert _ingest(tmp_path, monkeypatch, {}) == 0, capsys.readouterr().err
        assert rx.span_count() == 33_307 and max(r.body_bytes for r in rx.received) <= 1 << 20


# ---- 2. exporter selection, traces-only backends ------------------------------------------------


def test_a_grpc_request_over_the_receivers_limit_fails_at_once_with_the_setting_to_lower(tmp_path, monkeypatch, capsys) -> None:
    with OtlpReceiver(max_receive_bytes=DEFAULT_LIMIT) as rx:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.grpc_endpoint, "PLASMIENT_OTLP_MAX_REQUEST_MIB": "8"}
        code = _ingest(tmp_path, monkeypatch, env)
    err = capsys.readouterr().err
    assert code == 1 and "RESOURCE_EXHAUSTED" in err and "PLASMIENT_OTLP_MAX_REQUEST_MIB" in err
    assert "[1 attempt " in err  # not retried as if the backend were busy


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_traces_only_backend_gets_every_span_and_ingest_exits_0_saying_so_once(protocol, tmp_path, monkeypatch, capsys) -> None:
    with OtlpReceiver(signals=("traces",)) as rx:
        endpoint = rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint
        code = _ingest(tmp_path, monkeypatch, {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol})
        err = capsys.readouterr().err
        assert code == 0, err
        assert _arrived_ids(rx) == _expected_ids()
    lines = [line for line in err.splitlines() if "metrics" in line]
    assert len(lines) == 1 and "OTEL_METRICS_EXPORTER=none" in lines[0]
    assert ("UNIMPLEMENTED" if protocol == "grpc" else "HTTP 405") in lines[0]
    assert not list(tmp_path.glob("plasmient-spill/*.jsonl"))  # not an outage: nothing to replay


def test_otel_metrics_exporter_none_sends_no_metrics_request(tmp_path, monkeypatch, capsys) -> None:
    with OtlpReceiver(signals=("traces",)) as rx:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.http_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_METRICS_EXPORTER": "none"}
        assert _ingest(tmp_path, monkeypatch, env) == 0
        assert rx.span_count() == 33_307 and rx.refused == []  # not even one refused metrics request
    assert "metrics" not in capsys.readouterr().err


def test_otel_traces_exporter_none_sends_nothing_and_writes_no_default_file(tmp_path, monkeypatch, capsys) -> None:
    with OtlpReceiver() as rx:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.grpc_endpoint, "OTEL_TRACES_EXPORTER": "none"}
        assert _ingest(tmp_path, monkeypatch, env) == 0
        assert rx.received == [] and not (tmp_path / "traces.jsonl").exists()


def test_otel_metrics_exporter_otlp_sends_metrics_alone(tmp_path, monkeypatch, capsys) -> None:
    with OtlpReceiver() as rx:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.grpc_endpoint, "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "otlp"}
        assert _ingest(tmp_path, monkeypatch, env) == 0, capsys.readouterr().err
        assert rx.traces == [] and rx.wait_for(1, signal="metrics", timeout=5)
        steps = {dp.as_int for req in rx.metrics for rm in req.resource_metrics for sm in rm.scope_metrics
                 for m in sm.metrics if m.name == "plasmient.step.trace" for dp in m.gauge.data_points}
    raw_steps = {int(e["name"].split("#")[1]) for e in raw_trace(BIG)["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
    assert steps and steps <= raw_steps


def test_console_exporters_write_otlp_json_to_stderr(tmp_path, monkeypatch, capfd) -> None:
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_METRICS_EXPORTER": "console"}
    assert _ingest(tmp_path, monkeypatch, env) == 0
    docs = [orjson.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    spans = sum(len(ss["spans"]) for d in docs for rs in d.get("resourceSpans", []) for ss in rs["scopeSpans"])
    assert spans == 33_307 and any("resourceMetrics" in d for d in docs)
    assert not (tmp_path / "traces.jsonl").exists()


def test_an_exporter_plasmient_does_not_implement_is_named_and_ignored(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    assert main(["ingest", str(trace_path("h100/bert_small_inference.json.gz")), "--job-id", "j"]) == 0
    err = capsys.readouterr().err
    assert "OTEL_METRICS_EXPORTER='prometheus'" in err and "ignoring prometheus" in err
    assert (tmp_path / "traces.jsonl").exists()


# ---- 3. a slow backend -------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_busy_backend_answering_503_with_retry_after_still_gets_the_whole_trace(protocol, tmp_path, monkeypatch, capsys) -> None:
    with OtlpReceiver() as rx:
        # Busy for the first 2 requests, asking for 1 s each: 2 s, more than the 1.5 s timeout of one request.
        rx.fail_next(2, grpc_code=grpc.StatusCode.RESOURCE_EXHAUSTED, http_status=503, retry_after="1")
        endpoint = rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
               "OTEL_EXPORTER_OTLP_TIMEOUT": "1500"}
        started = time.monotonic()
        code = _ingest(tmp_path, monkeypatch, env)
        assert code == 0, capsys.readouterr().err
        assert time.monotonic() - started >= 2.0  # both busy answers were waited out as asked
        assert _arrived_ids(rx) == _expected_ids()


def test_a_grpc_backend_saying_when_to_retry_in_its_status_details_is_waited_out() -> None:
    """gRPC has no Retry-After header: a busy server says when to come back with a RetryInfo detail in
    the status that ends the call (trailer grpc-status-details-bin). Unread, the client would retry after
    its own first backoff of about 0.5 s; read, it waits the 1.5 s asked."""
    from plasmient_trace.export.otlp import OtlpClient
    from plasmient_trace.export.otlp_config import OtlpConfig

    request = trace_service_pb2.ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.add(trace_id=b"\x01" * 16, span_id=b"\x02" * 8, name="s")
    with OtlpReceiver() as rx:
        rx.fail_next(1, grpc_code=grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after="1.5")
        with OtlpClient(OtlpConfig.from_env({}, endpoint=rx.grpc_endpoint).for_signal("traces", {})) as client:
            started = time.monotonic()
            client.export(request.SerializeToString())
            waited = time.monotonic() - started
        assert len(rx.traces) == 1
    assert waited >= 1.5


def test_a_backend_busy_for_good_ends_within_the_backpressure_budget_naming_the_signal(tmp_path, monkeypatch, capsys) -> None:
    with OtlpReceiver() as rx:
        rx.fail_next(10**6, http_status=503, retry_after="1")
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.http_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
               "OTEL_EXPORTER_OTLP_TIMEOUT": "1000", "PLASMIENT_OTLP_BACKPRESSURE_S": "2.5"}
        code = _ingest(tmp_path, monkeypatch, env)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert "failed for traces:" in err[0] and "HTTP 503" in err[0] and "plasmient replay" in err[0]
    spilled = [line for f in (tmp_path / "plasmient-spill").glob("traces*.jsonl") for line in f.read_bytes().splitlines()]
    assert sum(len(ss["spans"]) for line in spilled for rs in orjson.loads(line)["resourceSpans"] for ss in rs["scopeSpans"]) == 33_307


# ---- 4. --rebase-time --------------------------------------------------------------------------


def test_rebase_time_moves_every_absolute_time_by_one_offset() -> None:
    batch = ingested("a100/nccl_training_rank0_of2.json.gz").batch
    now = 1_900_000_000_000_000_000
    moved, offset = rebase_time(batch, now)
    t0, t1 = batch.table, moved.table
    assert t1.column("end_ns").to_numpy().max() == now
    for col in ("start_ns", "end_ns", "plasmient.device.start_ns"):
        before, after = t0.column(col).to_pylist(), t1.column(col).to_pylist()
        assert [a is None for a in after] == [b is None for b in before]  # unknown stays unknown
        assert {a - b for a, b in zip(after, before) if b is not None} == {offset}
    assert t1.column("plasmient.clock.offset_ns").equals(t0.column("plasmient.clock.offset_ns"))  # relative: kept
    assert t1.column("trace_id").equals(t0.column("trace_id"))
    assert offset > 0  # the recording is older than the chosen now


def test_ingest_rebase_time_ends_the_last_span_now_and_keeps_the_trace_id(tmp_path, capsys) -> None:
    name = "h100/bert_small_inference.json.gz"
    out, plain = tmp_path / "r.jsonl", tmp_path / "p.jsonl"
    assert main(["ingest", str(trace_path(name)), "--job-id", "demo", "--out", str(plain), "--quiet"]) == 0
    before = time.time_ns()
    assert main(["ingest", str(trace_path(name)), "--job-id", "demo", "--out", str(out), "--rebase-time"]) == 0
    after = time.time_ns()
    assert "--rebase-time" in capsys.readouterr().err
    a, b = read_jsonl(plain).table, read_jsonl(out).table
    assert before <= b.column("end_ns").to_numpy().max() <= after
    shift = b.column("start_ns").to_numpy() - a.column("start_ns").to_numpy()
    assert (shift == shift[0]).all() and (b.column("end_ns").to_numpy() - a.column("end_ns").to_numpy() == shift[0]).all()
    assert b.column("trace_id").equals(a.column("trace_id"))


# ---- 5. semantic-convention metric names -------------------------------------------------------


@pytest.mark.parametrize("name", ["a100/nccl_training_rank0_of2.json.gz", "h100/bert_small_inference.json.gz"])
def test_hw_gpu_utilization_carries_each_single_gpu_ranks_resident_utilisation(name) -> None:
    from plasmient_trace.export.metrics import metric_requests

    batch = ingested(name).batch
    t = batch.table
    ranks = [r for r in t.select(["span_id", "plasmient.level", "plasmient.gpus", "plasmient.util.resident", "resource_index"]).to_pylist()
             if r["plasmient.level"] == "rank" and r["plasmient.gpus"] == 1 and r["plasmient.util.resident"] is not None]
    assert ranks
    points = {}
    for request in metric_requests(batch):
        for rm in request.resource_metrics:
            for m in (m for sm in rm.scope_metrics for m in sm.metrics if m.name == "hw.gpu.utilization"):
                assert m.unit == "1" and m.HasField("gauge")
                for dp in m.gauge.data_points:
                    attrs = {kv.key: kv.value.string_value or kv.value.int_value for kv in dp.attributes}
                    assert attrs["hw.type"] == "gpu" and attrs["hw.id"] and attrs["hw.gpu.task"] == "general"
                    points[int.from_bytes(dp.exemplars[0].span_id, "big")] = (dp.as_double, attrs)
    assert set(points) == {r["span_id"] for r in ranks}
    for r in ranks:
        value, attrs = points[r["span_id"]]
        assert value == r["plasmient.util.resident"] and 0 < value <= 1
        model = batch.resources[r["resource_index"]].get("plasmient.gpu.model")
        assert attrs.get("hw.model") == model if model else "hw.model" not in attrs


@pytest.mark.parametrize(("env", "configured", "traces", "metrics"), [
    ({}, False, set(), set()),                                              # embedded default: the file only
    ({}, True, {"otlp"}, {"otlp"}),                                         # an endpoint: both signals over OTLP
    ({"OTEL_METRICS_EXPORTER": "none"}, True, {"otlp"}, set()),             # traces-only backend
    ({"OTEL_TRACES_EXPORTER": "otlp"}, False, {"otlp"}, {"otlp"}),          # the spec's default endpoint
    ({"OTEL_TRACES_EXPORTER": "console"}, True, {"console"}, set()),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "otlp"}, True, set(), {"otlp"}),
    ({"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_METRICS_EXPORTER": "console"}, True, {"otlp", "console"}, {"console"}),
    ({"OTEL_TRACES_EXPORTER": "none,otlp"}, True, set(), set()),           # none wins
])
def test_exporter_selection_follows_the_sdk_environment_spec(env, configured, traces, metrics) -> None:
    from plasmient_trace.export.selection import select_exporters

    choice = select_exporters(env, configured)
    assert (set(choice.traces), set(choice.metrics)) == (traces, metrics) and choice.notes == ()


def test_metrics_over_http_json_stay_under_the_request_limit_too() -> None:
    from plasmient_trace.export.metrics import send_metrics
    from plasmient_trace.export.otlp import OtlpConfig

    batch = ingested("a100/nccl_training_rank0_of2.json.gz").batch
    limit = 12 * 1024  # the whole step's metrics are ~7 KB in protobuf but ~18 KB as JSON
    with OtlpReceiver(max_receive_bytes=limit) as rx:
        config = OtlpConfig.from_env({}, endpoint=rx.http_endpoint, protocol="http/json", max_request_bytes=limit)
        stats = send_metrics(batch, config)
        assert rx.refused == [] and stats.requests == len(rx.metrics) >= 2
        points = sum(len(m.gauge.data_points) + len(m.sum.data_points) for req in rx.metrics
                     for rm in req.resource_metrics for sm in rm.scope_metrics for m in sm.metrics)
    assert points == stats.data_points > 0 and max(r.body_bytes for r in rx.received) <= limit
