"""Step metrics with exemplars (plasmient_trace.export.metrics): content, and delivery over real OTLP."""

from __future__ import annotations

from collections import Counter
from functools import lru_cache

import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from conftest import trace_path
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from plasmient_trace.conventions import SpanBatch
from plasmient_trace.export.metrics import GAUGES, metric_requests, request_json

MULTIRANK = ["a100_multirank/rank-0.json.gz", "a100_multirank/rank-1.json.gz"]


@lru_cache(maxsize=None)
def _batch(gpu_model: str | None = "NVIDIA A100-SXM4-80GB") -> SpanBatch:
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    return ingest_paths([trace_path(p) for p in MULTIRANK], IngestOptions(job_id="metrics-job", gpu_model=gpu_model)).batch


def _spans(batch: SpanBatch) -> dict[tuple[bytes, int], dict]:
    """(trace id, span id) -> row, for the spans metrics come from."""
    t = batch.table.filter(pc.fill_null(pc.is_in(batch.table.column("plasmient.level"), pa.array(["rank", "fleet"])), False))
    return {(r["trace_id"], r["span_id"]): r for r in t.to_pylist()}


def _points(requests: list[ExportMetricsServiceRequest]) -> list[tuple[str, dict, object, dict]]:
    """(metric name, point attributes, point, resource attributes) for every data point."""
    out = []
    for req in requests:
        for rm in req.resource_metrics:
            res = {kv.key: kv.value for kv in rm.resource.attributes}
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    for dp in getattr(m, m.WhichOneof("data")).data_points:
                        attrs = {kv.key: getattr(kv.value, kv.value.WhichOneof("value")) for kv in dp.attributes}
                        out.append((m.name, attrs, dp, res))
    return out


def test_every_rank_and_fleet_step_has_each_gauge_with_its_span_as_exemplar() -> None:
    batch = _batch()
    spans = _spans(batch)
    points = _points(list(metric_requests(batch)))
    for name, attr, _, _ in GAUGES:
        mine = [(a, dp) for n, a, dp, _ in points if n == name]
        # 2 ranks x 2 steps + 2 fleet steps, every one with a known value (A100 peak known).
        assert len(mine) == len(spans) == 6, name
        seen = set()
        for attrs, dp in mine:
            (ex,) = dp.exemplars
            span = spans[(ex.trace_id, int.from_bytes(ex.span_id, "big"))]
            seen.add((ex.trace_id, int.from_bytes(ex.span_id, "big")))
            assert dp.as_double == pytest.approx(span[attr]) and ex.as_double == dp.as_double
            assert dp.time_unix_nano == span["end_ns"] == ex.time_unix_nano
            assert attrs["plasmient.level"] == span["plasmient.level"]
            assert attrs["plasmient.job.id"] == "metrics-job"
            assert attrs.get("plasmient.rank") == (span["plasmient.rank"] if span["plasmient.level"] == "rank" else None)
            assert "plasmient.step" not in attrs  # a label per step would explode series cardinality
        assert seen == set(spans)


def test_points_sit_under_the_resource_of_their_span() -> None:
    batch = _batch()
    for name, attrs, _dp, res in _points(list(metric_requests(batch))):
        if attrs["plasmient.level"] == "rank":
            assert res["plasmient.rank"].int_value == attrs["plasmient.rank"], name
        else:
            assert "plasmient.rank" not in res


def test_an_unknown_peak_leaves_no_mfu_point_rather_than_a_fake_one() -> None:
    batch = _batch(gpu_model=None)  # this job's traces name no GPU: MFU is unknown
    names = Counter(n for n, *_ in _points(list(metric_requests(batch))))
    assert "plasmient.step.mfu" not in names
    assert names["plasmient.step.util.resident"] == 6


def test_steps_counter_is_cumulative_per_series_and_carries_the_exemplars() -> None:
    batch = _batch()
    spans = _spans(batch)
    series: dict[tuple, list] = {}
    for name, attrs, dp, _ in _points(list(metric_requests(batch))):
        if name == "plasmient.steps":
            series.setdefault((attrs["plasmient.level"], attrs.get("plasmient.rank")), []).append(dp)
    assert set(series) == {("fleet", None), ("rank", 0), ("rank", 1)}
    for dps in series.values():
        dps.sort(key=lambda d: d.time_unix_nano)
        assert [d.as_int for d in dps] == [1, 2]
        assert len({d.start_time_unix_nano for d in dps}) == 1
        for d in dps:
            (ex,) = d.exemplars
            assert (ex.trace_id, int.from_bytes(ex.span_id, "big")) in spans


def test_trace_info_gauge_names_each_fleet_step_trace() -> None:
    batch = _batch()
    info = [(a, dp) for n, a, dp, _ in _points(list(metric_requests(batch))) if n == "plasmient.step.trace"]
    fleet = {r["plasmient.step"]: r["trace_id"] for r in _spans(batch).values() if r["plasmient.level"] == "fleet"}
    assert {dp.as_int: bytes.fromhex(a["trace_id"]) for a, dp in info} == fleet


def test_requests_split_between_resources_lose_nothing() -> None:
    batch = _batch()
    whole = list(metric_requests(batch))
    split = list(metric_requests(batch, max_bytes=1))
    assert len(whole) == 1 and len(split) == len(whole[0].resource_metrics) > 1
    key = lambda p: (p[0], p[2].SerializeToString())  # noqa: E731
    assert sorted(map(key, _points(split))) == sorted(map(key, _points(whole)))


def test_otlp_json_uses_hex_ids() -> None:
    batch = _batch()
    (req,) = metric_requests(batch)
    doc = orjson.loads(request_json(req))
    trace_hex = {t.hex() for t in batch.trace_ids()}
    exemplars = [ex for rm in doc["resourceMetrics"] for sm in rm["scopeMetrics"] for m in sm["metrics"]
                 for dp in (m.get("gauge") or m.get("sum"))["dataPoints"] for ex in dp["exemplars"]]
    assert exemplars and all(ex["traceId"] in trace_hex and len(ex["spanId"]) == 16 for ex in exemplars)
    sums = [m["sum"] for rm in doc["resourceMetrics"] for sm in rm["scopeMetrics"] for m in sm["metrics"] if "sum" in m]
    assert sums and all(s["aggregationTemporality"] == 2 and s["isMonotonic"] for s in sums)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf", "http/json"])
def test_metrics_arrive_over_otlp_and_exemplars_name_existing_traces(protocol: str) -> None:
    from otlp_receiver import OtlpReceiver

    from plasmient_trace.export.metrics import send_metrics
    from plasmient_trace.export.otlp import OtlpConfig

    batch = _batch()
    spans = _spans(batch)
    with OtlpReceiver() as rx:
        endpoint = rx.grpc_endpoint if protocol == "grpc" else rx.http_endpoint
        config = OtlpConfig.from_env({}, endpoint=endpoint, protocol=protocol, timeout_s=10)
        stats = send_metrics(batch, config)
        assert rx.wait_for(requests=stats.requests, signal="metrics", timeout=120)
        got = rx.metrics
    assert not rx.traces  # metrics went to the metrics service / path
    points = _points(got)
    assert len(points) == stats.data_points == len(_points(list(metric_requests(batch))))
    trace_ids = set(batch.trace_ids())
    for name, _, dp, _ in points:
        (ex,) = dp.exemplars
        assert ex.trace_id in trace_ids, name
        assert (ex.trace_id, int.from_bytes(ex.span_id, "big")) in spans, name


def test_an_ingest_in_groups_of_steps_continues_one_step_counter_per_series(monkeypatch, capsys) -> None:
    """`plasmient ingest --chunk-rows 1` sends each step as its own batch; the step counter of each rank and
    of the fleet still counts 1, 2, ... from one start time, across the requests, over real OTLP/gRPC."""
    from otlp_receiver import OtlpReceiver

    from plasmient_trace.cli import main

    path = trace_path("v100/resnet50_training.json.gz")  # 6 steps, one rank
    with OtlpReceiver() as rx:
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
        code = main(["ingest", str(path), "--job-id", "groups", "--endpoint", rx.grpc_endpoint, "--protocol", "grpc",
                     "--chunk-rows", "1", "--quiet"])
        assert code == 0, capsys.readouterr().err
        assert rx.wait_for(requests=6, signal="metrics", timeout=120)
        got = rx.metrics
    assert len(got) == 6  # one request per step: the batches really were separate
    series: dict[tuple, list] = {}
    for name, attrs, dp, _ in _points(got):
        if name == "plasmient.steps":
            series.setdefault((attrs["plasmient.level"], attrs.get("plasmient.rank")), []).append(dp)
    assert set(series) == {("fleet", None), ("rank", 0)}
    for dps in series.values():
        dps.sort(key=lambda d: d.time_unix_nano)
        assert [d.as_int for d in dps] == [1, 2, 3, 4, 5, 6]
        assert len({d.start_time_unix_nano for d in dps}) == 1
        assert dps[0].start_time_unix_nano <= dps[0].time_unix_nano


def test_a_cpu_only_rank_is_named_as_a_cpu_and_reports_no_gpu_utilisation(warm_cache, monkeypatch) -> None:
    # A live CPU run put the CPU's name in plasmient.gpu.model and its op residency in hw.gpu.utilization
    # (hw.type gpu, hw.model "AMD EPYC (1 threads)"): a GPU dashboard showed a GPU the job never had. A peak
    # given by the user for an unnamed device was named "user-specified", which is no device either.
    import torch

    from capture_helpers import live_capture
    from plasmient_trace.metrics.cpu_peak import cpu_spec
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    monkeypatch.setenv("PLASMIENT_CACHE_DIR", str(warm_cache))  # the CPU's calibrated peaks, as after a first run
    threads = torch.get_num_threads()
    model, x = torch.nn.Linear(64, 64), torch.randn(32, 64)
    with live_capture(close_timeout=60, every=1, job_id="cpu-metrics") as (session, sink):
        for _ in range(3):
            with session.step():
                model(x).sum().backward()
    assert not session.failed
    resources = [r for b in sink.batches for r in b.resources if "plasmient.rank" in r]
    assert resources and all(r["plasmient.cpu.model"] == cpu_spec(warm_cache, threads).model for r in resources)
    assert not any("plasmient.gpu.model" in r for r in resources)
    points = [p for b in sink.batches for p in _points(list(metric_requests(b)))]
    assert {name for name, *_ in points} >= {"plasmient.step.mfu", "plasmient.step.util.resident"}
    assert not [p for p in points if p[0].startswith("hw.gpu")]

    user_peak = ingest_paths([trace_path("cpu_only/rank-34.json.gz")], IngestOptions(job_id="cpu", peak_tflops=1.0)).batch
    assert not any("plasmient.gpu.model" in r or "plasmient.cpu.model" in r for r in user_peak.resources)
    points = _points(list(metric_requests(user_peak)))
    assert [p for p in points if p[0] == "plasmient.step.util.resident"]
    assert not [p for p in points if p[0].startswith("hw.gpu")]
