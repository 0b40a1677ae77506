"""Exporters of a SpanBatch: OTLP/JSON lines file, OTLP protobuf, OTLP over gRPC/HTTP, Parquet.

Submodules load lazily (``from plasmient_trace.export import send_spans`` imports grpc only then),
so writing a JSON lines file never pays for the gRPC import.

* :mod:`.otlp_json`  ``write_jsonl``, ``encode_jsonl_lines``, ``read_jsonl`` (Collector file-exporter format)
* :mod:`.otlp_proto` ``encode_requests`` (serialized ExportTraceServiceRequest, split at a byte limit)
* :mod:`.otlp`       ``OtlpConfig.from_env``, ``export_spans``/``send_spans``, ``ExportError``, ``OtlpClient``
  (the one retry loop), ``redact``
* :mod:`.parquet`    ``write_parquet``
* :mod:`.delivery`   ``Delivery``: the one delivery path of ingest and live capture (sinks, bounded queue, spill)
* :mod:`.spill`      the spill directory and ``replay`` (``plasmient replay``)
* :mod:`.selection`  ``select_exporters``: OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER for ingest and live
* :mod:`.rebase`     ``rebase_time`` (``plasmient ingest --rebase-time``)
* :mod:`.files`      what every writer asks of a path: a special file? which outputs may a failed run remove?
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "write_jsonl": "otlp_json",
    "encode_jsonl_lines": "otlp_json",
    "read_jsonl": "otlp_json",
    "batch_from_otlp_dicts": "otlp_json",
    "encode_requests": "otlp_proto",
    "DEFAULT_MAX_REQUEST_BYTES": "otlp_proto",
    "OtlpConfig": "otlp",
    "OtlpClient": "otlp",
    "ExportError": "otlp",
    "UnsupportedSignal": "otlp",
    "select_exporters": "selection",
    "rebase_time": "rebase",
    "ExportStats": "otlp",
    "send_spans": "otlp",
    "export_spans": "otlp",
    "Delivery": "delivery",
    "write_parquet": "parquet",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
