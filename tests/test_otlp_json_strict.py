"""The test receiver's OTLP/JSON parser means what protobuf's own json_format means, and refuses what it refuses.

The receiver reads every http/json request with ``otlp_json_strict`` (json_format took about 20 s for a
33k-span ingest). These tests hold it to json_format as the oracle: the same messages from real requests
(traces of a real ingest, step metrics with exemplars), and a refusal wherever json_format refuses.
"""

from __future__ import annotations

import base64
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conftest import ingested  # noqa: E402
from otlp_json_strict import OtlpJsonError, parse_otlp_json  # noqa: E402

from plasmient_trace.export import otlp_json  # noqa: E402
from plasmient_trace.export.metrics import metric_requests, request_json  # noqa: E402

_HEX_IDS = {"traceId", "spanId", "parentSpanId", "trace_id", "span_id", "parent_span_id"}


def _json_format_parse(doc: Any, message_type: type) -> Any:
    """json_format.ParseDict after the one OTLP rule it does not know: ids are hex, not base64."""

    def convert(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (base64.b64encode(bytes.fromhex(v)).decode() if k in _HEX_IDS and isinstance(v, str) else convert(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [convert(v) for v in node]
        return node

    return json_format.ParseDict(convert(doc), message_type())


def test_trace_requests_of_a_real_ingest_parse_to_the_messages_json_format_gives() -> None:
    batch = ingested("h100/bert_small_inference.json.gz").batch
    lines = list(otlp_json.encode_jsonl_lines(batch))
    assert lines
    spans = 0
    for line in lines:
        doc = orjson.loads(line)
        ours = parse_otlp_json(doc, ExportTraceServiceRequest)
        assert ours == _json_format_parse(doc, ExportTraceServiceRequest)
        spans += sum(len(ss.spans) for rs in ours.resource_spans for ss in rs.scope_spans)
    assert spans == batch.table.num_rows


def test_metric_requests_with_exemplars_parse_to_the_messages_json_format_gives() -> None:
    batch = ingested("a100/nccl_training_rank0_of2.json.gz").batch
    requests = list(metric_requests(batch))
    assert requests
    for request in requests:
        doc = orjson.loads(request_json(request))
        ours = parse_otlp_json(doc, ExportMetricsServiceRequest)
        assert ours == _json_format_parse(doc, ExportMetricsServiceRequest) == request
    assert any(dp.exemplars for r in requests for rm in r.resource_metrics for sm in rm.scope_metrics
               for m in sm.metrics for dp in m.gauge.data_points)


def _span_doc(**span: Any) -> dict[str, Any]:
    base = {"traceId": "0af7651916cd43dd8448eb211c80319c", "spanId": "00f067aa0ba902b7", "name": "s",
            "startTimeUnixNano": "1", "endTimeUnixNano": "2"}
    return {"resourceSpans": [{"scopeSpans": [{"spans": [{**base, **span}]}]}]}


BAD = {
    "unknown field": _span_doc(nmae="typo"),
    "string for a string field given a number": _span_doc(name=3),
    "time that is not an integer": _span_doc(startTimeUnixNano="soon"),
    "time given as a bool": _span_doc(startTimeUnixNano=True),
    "uint64 out of range": _span_doc(startTimeUnixNano=str(2**64)),
    "negative uint64": _span_doc(endTimeUnixNano="-1"),
    "two members of one oneof": _span_doc(attributes=[{"key": "k", "value": {"stringValue": "a", "intValue": "1"}}]),
    "a double that is a word": _span_doc(attributes=[{"key": "k", "value": {"doubleValue": "fast"}}]),
    "attributes not a list": _span_doc(attributes={"key": "k"}),
    "a span that is a string": {"resourceSpans": [{"scopeSpans": [{"spans": ["span"]}]}]},
    "an enum name that does not exist": _span_doc(kind="SPAN_KIND_NOPE"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_what_json_format_refuses_is_refused_with_the_field_path(case: str) -> None:
    doc = BAD[case]
    with pytest.raises((json_format.ParseError, ValueError, TypeError)):
        _json_format_parse(doc, ExportTraceServiceRequest)
    with pytest.raises(OtlpJsonError) as err:
        parse_otlp_json(doc, ExportTraceServiceRequest)
    assert str(err.value).startswith("ExportTraceServiceRequest.resourceSpans[0].scopeSpans[0].spans[0]")


def test_non_finite_doubles_and_proto_field_names_parse_as_json_format_parses_them() -> None:
    doc = _span_doc(attributes=[{"key": "a", "value": {"doubleValue": "NaN"}},
                                {"key": "b", "value": {"double_value": "-Infinity"}}],
                    parent_span_id="00f067aa0ba902b8", kind=2, status={})
    ours = parse_otlp_json(doc, ExportTraceServiceRequest)
    theirs = _json_format_parse({**doc}, ExportTraceServiceRequest)
    assert json_format.MessageToDict(ours) == json_format.MessageToDict(theirs)
    span = ours.resource_spans[0].scope_spans[0].spans[0]
    assert span.HasField("status") and span.parent_span_id == bytes.fromhex("00f067aa0ba902b8")
