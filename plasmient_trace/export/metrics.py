"""OTel metrics per step (MFU, resident utilisation, stall fraction, wasted $), with exemplars that open the trace.

From a SpanBatch, every ``rank`` span (one per rank per step) and every ``fleet`` span (one per step)
becomes one data point of each gauge below, stamped at the span's end, under the span's resource,
with one ``Exemplar`` whose trace_id/span_id are that span's: a dashboard or alert that finds a bad
point is one click from the step's trace.

| metric | type | unit | from span attribute |
|---|---|---|---|
| plasmient.step.mfu | gauge | 1 | plasmient.mfu |
| plasmient.step.util.resident | gauge | 1 | plasmient.util.resident |
| plasmient.step.stall_fraction | gauge | 1 | plasmient.stall_fraction |
| plasmient.step.wasted_usd | gauge | USD | plasmient.cost.wasted_usd |
| plasmient.steps | monotonic cumulative sum | {step} | one per traced step |
| plasmient.step.trace | gauge (value: step) | 1 | fleet spans only; attribute trace_id |
| hw.gpu.utilization | gauge | 1 | plasmient.util.resident of GPU rank spans with exactly one GPU |

``hw.gpu.utilization`` is the OpenTelemetry hardware semantic convention's GPU utilisation (the
kernel-resident fraction, what NVML reports), so dashboards built for NVML/DCGM exporters show the
traced steps beside their samples. Its attributes are the convention's: ``hw.type`` = gpu,
``hw.gpu.task`` = general, ``hw.id`` = the device UUID where the resource knows it, else
``rank<N>`` (one device per rank; the device index is not guessed), ``hw.model`` where known, plus
``plasmient.job.id`` and ``plasmient.rank``. Ranks charged for several GPUs get no point: one value
cannot be every device's. The ``plasmient.*`` names stay: they are what alerts.yml reads.

Data point attributes: ``plasmient.job.id``, ``plasmient.level`` (rank | fleet) and, on rank
points, ``plasmient.rank``. The step number is deliberately *not* a label (one series per step
would explode Prometheus' cardinality); the exemplar carries the step's trace instead. A span whose
attribute is absent (e.g. no MFU when the device peak is unknown) yields no point for that metric.

Why the two extra metrics: the OpenTelemetry-to-Prometheus conversion keeps exemplars only on
histograms and monotonic sums and drops them on gauges (OTel spec, "Prometheus and OpenMetrics
compatibility"). ``plasmient.steps`` carries the same exemplars on a counter so they reach
Prometheus and Grafana's exemplar-to-Tempo link; ``plasmient.step.trace`` exposes the latest
traced step's trace id as a label, the only way a Prometheus alert template (which sees labels,
values and ``query`` results, never exemplars) can put a trace link in an annotation. It adds one
series per traced step (steps are sampled by the profiler, so this is bounded by the capture rate).

Transport: OTLP/gRPC ``MetricsService/Export`` or OTLP/HTTP ``POST .../v1/metrics`` (protobuf or
JSON) through the trace exporter's :class:`.otlp.OtlpClient`: same configuration, retries, timeout.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AGGREGATION_TEMPORALITY_CUMULATIVE,
    Exemplar,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource

from plasmient_trace.conventions import SCOPE_NAME, SpanBatch
from plasmient_trace.export.otlp_json import package_version
from plasmient_trace.export.otlp_proto import DEFAULT_MAX_REQUEST_BYTES, any_value_proto

__all__ = [
    "GAUGES",
    "METRIC_LEVELS",
    "MetricsSendStats",
    "metric_requests",
    "request_json",
    "send_metrics",
]

# (metric name, span attribute, unit, description)
GAUGES: tuple[tuple[str, str, str, str], ...] = (
    ("plasmient.step.mfu", "plasmient.mfu", "1", "model FLOPs utilisation of the step: flops / (peak * wall * gpus)"),
    ("plasmient.step.util.resident", "plasmient.util.resident", "1", "kernel-resident fraction of the step (what nvidia-smi utilization.gpu reports)"),
    ("plasmient.step.stall_fraction", "plasmient.stall_fraction", "1", "resident time that issued no useful math"),
    ("plasmient.step.wasted_usd", "plasmient.cost.wasted_usd", "USD", "cost of the step below the baseline MFU"),
)
STEPS_COUNTER = ("plasmient.steps", "{step}", "traced steps; exemplars name each step's trace")
TRACE_INFO = ("plasmient.step.trace", "1", "latest traced step (value) and its trace id (attribute trace_id), fleet level")
HW_GPU_UTILIZATION = ("hw.gpu.utilization", "1", "fraction of the traced step a kernel was resident on the GPU (semantic convention)")
METRIC_LEVELS = ("rank", "fleet")


@dataclass
class _Points:
    """The rank/fleet spans of a batch as numpy/python columns, in end-time order."""

    trace_id: list[bytes]
    span_id: np.ndarray
    resource: np.ndarray
    start: np.ndarray
    end: np.ndarray
    level: list[str]
    rank: list[int | None]
    job: list[str | None]
    step: list[int | None]
    gpus: list[int | None]
    device_type: list[str | None]
    values: dict[str, np.ndarray]   # span attribute -> float64 (NaN = absent)


def _select(batch: SpanBatch) -> _Points:
    t = batch.table
    mask = pc.fill_null(pc.is_in(t.column("plasmient.level"), pa.array(METRIC_LEVELS)), False)
    t = t.filter(mask)
    t = t.take(pc.sort_indices(t, [("end_ns", "ascending"), ("span_id", "ascending")]))

    def floats(name: str) -> np.ndarray:
        return pc.fill_null(t.column(name).cast(pa.float64()), float("nan")).to_numpy()

    return _Points(
        trace_id=t.column("trace_id").to_pylist(),
        span_id=t.column("span_id").to_numpy(),
        resource=t.column("resource_index").to_numpy(),
        start=t.column("start_ns").to_numpy(),
        end=t.column("end_ns").to_numpy(),
        level=t.column("plasmient.level").to_pylist(),
        rank=t.column("plasmient.rank").to_pylist(),
        job=t.column("plasmient.job.id").to_pylist(),
        step=t.column("plasmient.step").to_pylist(),
        gpus=t.column("plasmient.gpus").to_pylist(),
        device_type=t.column("plasmient.device.type").to_pylist(),
        values={attr: floats(attr) for _, attr, _, _ in GAUGES},
    )


def _kv(key: str, value: Any) -> KeyValue | None:
    v = any_value_proto(value)
    return None if v is None else KeyValue(key=key, value=v)


def _attributes(p: _Points, i: int) -> list[KeyValue]:
    out = [KeyValue(key="plasmient.level", value=AnyValue(string_value=p.level[i]))]
    if p.job[i] is not None:
        out.append(KeyValue(key="plasmient.job.id", value=AnyValue(string_value=p.job[i])))
    if p.level[i] == "rank" and p.rank[i] is not None:
        out.append(KeyValue(key="plasmient.rank", value=AnyValue(int_value=int(p.rank[i]))))
    return out


def _exemplar(p: _Points, i: int, value: float | int) -> Exemplar:
    ex = Exemplar(time_unix_nano=int(p.end[i]), trace_id=p.trace_id[i], span_id=int(p.span_id[i]).to_bytes(8, "big"))
    if isinstance(value, int):
        ex.as_int = value
    else:
        ex.as_double = value
    return ex


@dataclass
class StepCounter:
    """``plasmient.steps`` across batches: per series (level, job, rank), its start time and the steps counted,
    so one exporter's batches (a live job's, an ingest's groups of steps) continue one cumulative series
    instead of restarting it at every batch."""

    series: dict[tuple, tuple[int, int]] = field(default_factory=dict)


def _resource_metrics(batch: SpanBatch, p: _Points, rows: list[int], res_idx: int,
                      steps: StepCounter | None = None) -> ResourceMetrics:
    res = Resource()
    attrs = batch.resources[res_idx] if 0 <= res_idx < len(batch.resources) else {}
    for k, v in attrs.items():
        kv = _kv(str(k), v)
        if kv is not None:
            res.attributes.append(kv)
    scope = ScopeMetrics(scope=InstrumentationScope(name=SCOPE_NAME, version=package_version()))
    for name, attr, unit, desc in GAUGES:
        values = p.values[attr]
        metric = Metric(name=name, unit=unit, description=desc)
        metric.gauge.SetInParent()
        for i in rows:
            v = float(values[i])
            if not np.isfinite(v):
                continue
            metric.gauge.data_points.append(NumberDataPoint(
                attributes=_attributes(p, i), start_time_unix_nano=int(p.start[i]), time_unix_nano=int(p.end[i]),
                as_double=v, exemplars=[_exemplar(p, i, v)],
            ))
        if metric.gauge.data_points:
            scope.metrics.append(metric)

    # Counter: cumulative per series (level, job, rank), counting from the first traced step the counter saw
    # (a StepCounter kept across batches), else from the first traced step of this batch.
    name, unit, desc = STEPS_COUNTER
    counter = Metric(name=name, unit=unit, description=desc)
    counter.sum.aggregation_temporality = AGGREGATION_TEMPORALITY_CUMULATIVE
    counter.sum.is_monotonic = True
    series: dict[tuple, list[int]] = defaultdict(list)
    for i in rows:
        series[(p.level[i], p.job[i], p.rank[i] if p.level[i] == "rank" else None)].append(i)
    counts = steps if steps is not None else StepCounter()
    for key, members in series.items():
        first_start, count = counts.series.get(key, (int(min(p.start[i] for i in members)), 0))
        for i in members:
            count += 1
            counter.sum.data_points.append(NumberDataPoint(
                attributes=_attributes(p, i), start_time_unix_nano=first_start, time_unix_nano=int(p.end[i]),
                as_int=count, exemplars=[_exemplar(p, i, 1)],
            ))
        counts.series[key] = (first_start, count)
    if counter.sum.data_points:
        scope.metrics.append(counter)

    name, unit, desc = TRACE_INFO
    info = Metric(name=name, unit=unit, description=desc)
    info.gauge.SetInParent()
    for i in rows:
        if p.level[i] != "fleet" or p.step[i] is None:
            continue
        attrs_i = _attributes(p, i) + [KeyValue(key="trace_id", value=AnyValue(string_value=p.trace_id[i].hex()))]
        info.gauge.data_points.append(NumberDataPoint(
            attributes=attrs_i, time_unix_nano=int(p.end[i]), as_int=int(p.step[i]), exemplars=[_exemplar(p, i, int(p.step[i]))],
        ))
    if info.gauge.data_points:
        scope.metrics.append(info)
    hw = _hw_gpu_utilization(p, rows, attrs)
    if hw.gauge.data_points:
        scope.metrics.append(hw)
    return ResourceMetrics(resource=res, scope_metrics=[scope])


def _hw_gpu_utilization(p: _Points, rows: list[int], resource: dict[str, Any]) -> Metric:
    name, unit, desc = HW_GPU_UTILIZATION
    metric = Metric(name=name, unit=unit, description=desc)
    metric.gauge.SetInParent()
    values = p.values["plasmient.util.resident"]
    uuid, model = resource.get("plasmient.gpu.uuid"), resource.get("plasmient.gpu.model")
    for i in rows:
        v = float(values[i])
        if p.level[i] != "rank" or p.device_type[i] != "gpu" or p.gpus[i] != 1 or not np.isfinite(v):
            continue  # a CPU-only rank's op residency is no GPU's utilisation
        hw_id = str(uuid) if uuid else f"rank{p.rank[i]}" if p.rank[i] is not None else None
        if hw_id is None:
            continue  # the convention requires hw.id
        attrs_i = _attributes(p, i) + [KeyValue(key="hw.id", value=AnyValue(string_value=hw_id)),
                                        KeyValue(key="hw.type", value=AnyValue(string_value="gpu")),
                                        KeyValue(key="hw.gpu.task", value=AnyValue(string_value="general"))]
        if model:
            attrs_i.append(KeyValue(key="hw.model", value=AnyValue(string_value=str(model))))
        metric.gauge.data_points.append(NumberDataPoint(
            attributes=attrs_i, start_time_unix_nano=int(p.start[i]), time_unix_nano=int(p.end[i]),
            as_double=v, exemplars=[_exemplar(p, i, v)],
        ))
    return metric


def metric_requests(batch: SpanBatch, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                    steps: StepCounter | None = None) -> Iterator[ExportMetricsServiceRequest]:
    """ExportMetricsServiceRequests for every rank and fleet span of the batch, each at most ~max_bytes.
    ``steps`` continues the step counter of earlier batches (and is updated).

    Requests split between resources (a resource's points are never split: one rank's points for the
    steps of one batch are a few KiB).
    """
    p = _select(batch)
    by_resource: dict[int, list[int]] = defaultdict(list)
    for i, r in enumerate(p.resource.tolist()):
        by_resource[int(r)].append(i)
    request, size = ExportMetricsServiceRequest(), 0
    for res_idx in sorted(by_resource):
        rm = _resource_metrics(batch, p, by_resource[res_idx], res_idx, steps)
        if not rm.scope_metrics[0].metrics:
            continue
        rm_size = rm.ByteSize() + 6
        if request.resource_metrics and size + rm_size > max_bytes:
            yield request
            request, size = ExportMetricsServiceRequest(), 0
        request.resource_metrics.append(rm)
        size += rm_size
    if request.resource_metrics:
        yield request


# --------------------------------------------------------------------------------------------
# Transport: the trace exporter's client, pointed at the metrics signal
# --------------------------------------------------------------------------------------------


@dataclass
class MetricsSendStats:
    endpoint: str
    protocol: str
    requests: int = 0
    data_points: int = 0
    rejected: int = 0
    retries: int = 0


def _data_points(request: ExportMetricsServiceRequest) -> int:
    n = 0
    for rm in request.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                n += len(getattr(m, m.WhichOneof("data")).data_points)
    return n


def request_json(request: ExportMetricsServiceRequest) -> bytes:
    """OTLP/JSON of a metrics request: protobuf JSON mapping, ids as hex, enums as integers."""
    import base64

    import orjson
    from google.protobuf.json_format import MessageToDict

    doc = MessageToDict(request, use_integers_for_enums=True)
    for rm in doc.get("resourceMetrics", []):
        for sm in rm.get("scopeMetrics", []):
            for m in sm.get("metrics", []):
                data = m.get("gauge") or m.get("sum") or {}
                for dp in data.get("dataPoints", []):
                    for ex in dp.get("exemplars", []):
                        for key in ("traceId", "spanId"):
                            if key in ex:
                                ex[key] = base64.b64decode(ex[key]).hex()
    return orjson.dumps(doc)


def export_metrics(client: Any, batch: SpanBatch, stop: Any = None, steps: StepCounter | None = None,
                   max_attempts: int | None = None) -> MetricsSendStats:
    """Deliver the batch's step metrics over an open metrics :class:`.otlp.OtlpClient`; raises
    :class:`.otlp.ExportError` when they cannot be (its retries, backoff and deadline; ``max_attempts`` as in
    :meth:`.otlp.OtlpClient.export`). ``steps``: the sender's step counter, continued from its earlier batches."""
    config = client.config
    stats = MetricsSendStats(endpoint=client.display_endpoint, protocol=config.protocol)
    attempts0 = client.attempts
    # Requests are sized in protobuf bytes; their OTLP/JSON is 2.5-2.6x larger on real traces (hex
    # ids, field names), so http/json splits at a third to stay under the same request limit.
    limit = config.max_request_bytes // 3 if config.protocol == "http/json" else config.max_request_bytes
    for request in metric_requests(batch, max_bytes=limit, steps=steps):
        body = request_json(request) if config.protocol == "http/json" else request.SerializeToString()
        rejected, _ = client.export(body, stop=stop, max_attempts=max_attempts)
        stats.requests += 1
        stats.data_points += _data_points(request)
        stats.rejected += rejected
    stats.retries = client.attempts - attempts0 - stats.requests
    return stats


def send_metrics(batch: SpanBatch, config: Any = None) -> MetricsSendStats:
    """Deliver the batch's step metrics over OTLP with a client of its own.

    ``config`` is the trace exporter's :class:`.otlp.OtlpConfig` (None: from OTEL_EXPORTER_OTLP_*);
    it is re-targeted to the metrics signal (OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, else the generic
    endpoint + /v1/metrics for HTTP, the same target for gRPC).
    """
    from plasmient_trace.export import otlp

    config = (config or otlp.OtlpConfig.from_env()).for_signal("metrics")
    with otlp.OtlpClient(config) as client:
        return export_metrics(client, batch)
