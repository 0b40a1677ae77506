"""A real OTLP receiver for tests: gRPC TraceService/MetricsService and HTTP /v1/traces, /v1/metrics.

Listens on 127.0.0.1 with ephemeral ports chosen at the first start and kept across restarts, so a
test can kill it mid-export (``stop()``: listeners closed, in-flight RPCs cancelled, open HTTP
keep-alive connections cut) and bring it back on the same endpoints (``start()``). It parses what
arrives (protobuf or OTLP/JSON, gzip or not) into the generated ExportTraceServiceRequest /
ExportMetricsServiceRequest messages and can inject failures and partial successes.

Like a real backend it can limit what it takes: ``max_receive_bytes`` (gRPC
``max_receive_message_length``; HTTP bodies above it get 413, as Jaeger, Tempo and the Collector
answer above their 4 MiB default) and ``signals`` (a traces-only backend: gRPC answers UNIMPLEMENTED
for metrics, HTTP 405). HTTP requests it refuses are counted in ``refused``.

    with OtlpReceiver() as rx:
        send_spans(batch, OtlpConfig.from_env({}, endpoint=rx.grpc_endpoint))
        rx.wait_for(requests=1)
        rx.traces  # [ExportTraceServiceRequest, ...]
"""

from __future__ import annotations

import base64
import gzip
import socket
import ssl
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import orjson
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from otlp_json_strict import OtlpJsonError, parse_otlp_json

__all__ = ["OtlpReceiver", "Received", "otlp_json_to_proto", "trace_request_to_dict"]

_REQUEST = {"traces": trace_service_pb2.ExportTraceServiceRequest, "metrics": metrics_service_pb2.ExportMetricsServiceRequest}
_RESPONSE = {"traces": trace_service_pb2.ExportTraceServiceResponse, "metrics": metrics_service_pb2.ExportMetricsServiceResponse}
_REJECTED_FIELD = {"traces": "rejected_spans", "metrics": "rejected_data_points"}
_HTTP_PATHS = {"/v1/traces": "traces", "/v1/metrics": "metrics"}


def otlp_json_to_proto(data: bytes, message_type: type[Message]) -> Message:
    """Parse an OTLP/JSON body (hex ids, integer enums) into a generated protobuf message, strictly
    (``otlp_json_strict``: unknown fields, wrong types and bad ids are refused)."""
    return parse_otlp_json(orjson.loads(data), message_type)


_ANY_JSON = {"string_value": "stringValue", "int_value": "intValue", "double_value": "doubleValue", "bool_value": "boolValue"}


def _any_value_dict(value: Any) -> dict[str, Any]:
    which = value.WhichOneof("value")
    if which is None:
        return {}
    if which == "array_value":
        return {"arrayValue": {"values": [_any_value_dict(v) for v in value.array_value.values]}}
    if which == "kvlist_value":
        return {"kvlistValue": {"values": [{"key": kv.key, "value": _any_value_dict(kv.value)} for kv in value.kvlist_value.values]}}
    if which == "bytes_value":
        return {"bytesValue": base64.b64encode(value.bytes_value).decode("ascii")}
    v = getattr(value, which)
    return {_ANY_JSON[which]: str(v) if which == "int_value" else v}


def trace_request_to_dict(request: trace_service_pb2.ExportTraceServiceRequest) -> dict[str, Any]:
    """OTLP/JSON-shaped dict of a received request, walked field by field.

    Independent of the exporter's own encoders (and ~50x faster than json_format.MessageToDict,
    which matters for tens of thousands of spans).
    """
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": [{"key": kv.key, "value": _any_value_dict(kv.value)} for kv in rs.resource.attributes]},
                "scopeSpans": [
                    {
                        "scope": {"name": ss.scope.name, "version": ss.scope.version},
                        "spans": [
                            {
                                "traceId": s.trace_id.hex(),
                                "spanId": s.span_id.hex(),
                                "parentSpanId": s.parent_span_id.hex(),
                                "name": s.name,
                                "kind": s.kind,
                                "startTimeUnixNano": str(s.start_time_unix_nano),
                                "endTimeUnixNano": str(s.end_time_unix_nano),
                                "attributes": [{"key": kv.key, "value": _any_value_dict(kv.value)} for kv in s.attributes],
                            }
                            for s in ss.spans
                        ],
                    }
                    for ss in rs.scope_spans
                ],
            }
            for rs in request.resource_spans
        ]
    }


@dataclass
class Received:
    """One export request as it arrived."""

    signal: str  # traces | metrics
    transport: str  # grpc | http
    request: Message
    content_type: str = ""  # http only
    content_encoding: str = ""  # http: Content-Encoding; grpc: grpc-encoding
    path: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # lower-cased names (HTTP headers / gRPC metadata)
    body_bytes: int = 0


@dataclass
class _Failure:
    count: int
    grpc_code: grpc.StatusCode
    http_status: int
    retry_after: str | None  # seconds: HTTP's Retry-After header, gRPC's RetryInfo status detail

    def grpc_status_details(self) -> bytes:
        """The google.rpc.Status a gRPC server sends (trailer grpc-status-details-bin) to ask for a retry
        after ``retry_after`` seconds, as HTTP's Retry-After does."""
        from google.rpc import error_details_pb2, status_pb2

        info = error_details_pb2.RetryInfo()
        info.retry_delay.FromNanoseconds(int(float(self.retry_after or 0) * 1e9))
        status = status_pb2.Status(code=self.grpc_code.value[0], message="failure injected by the test receiver")
        status.details.add().Pack(info)
        return status.SerializeToString()


class OtlpReceiver:
    """gRPC + HTTP OTLP receiver on 127.0.0.1; a context manager (start on enter, stop on exit)."""

    def __init__(self, host: str = "127.0.0.1", max_receive_bytes: int = 64 * 1024 * 1024,
                 signals: tuple[str, ...] = ("traces", "metrics"), tls: tuple[Path, Path] | None = None) -> None:
        self.host = host
        self.tls = tls  # (certificate chain PEM, private key PEM): both ports speak TLS
        self.max_receive_bytes = max_receive_bytes
        self.signals = signals
        self.refused: list[str] = []  # "signal: why" per request refused for size or signal
        self.grpc_port = 0
        self.http_port = 0
        self.received: list[Received] = []
        self._lock = threading.Condition()
        self._failures: list[_Failure] = []
        self._rejections: list[tuple[int, int, str]] = []  # (requests left, rejected count, message)
        self.delay_s = 0.0  # sleep before answering: a slow collector
        self._grpc_server: grpc.Server | None = None
        self._http_server: ThreadingHTTPServer | None = None
        self.http_errors: list[str] = []
        self._http_thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()

    # -- endpoints ---------------------------------------------------------------------------

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def grpc_endpoint(self) -> str:
        return f"{self.scheme}://{self.host}:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        """Base URL (the generic OTEL_EXPORTER_OTLP_ENDPOINT form; /v1/traces is appended by clients)."""
        return f"{self.scheme}://{self.host}:{self.http_port}"

    @property
    def running(self) -> bool:
        return self._grpc_server is not None

    # -- what arrived ------------------------------------------------------------------------

    @property
    def traces(self) -> list[trace_service_pb2.ExportTraceServiceRequest]:
        with self._lock:
            return [r.request for r in self.received if r.signal == "traces"]

    @property
    def metrics(self) -> list[metrics_service_pb2.ExportMetricsServiceRequest]:
        with self._lock:
            return [r.request for r in self.received if r.signal == "metrics"]

    def span_count(self) -> int:
        return sum(len(ss.spans) for req in self.traces for rs in req.resource_spans for ss in rs.scope_spans)

    def clear(self) -> None:
        with self._lock:
            self.received.clear()

    def wait_for(self, requests: int = 1, spans: int | None = None, signal: str = "traces", timeout: float = 120.0) -> bool:
        """Block until ``requests`` requests (or ``spans`` spans) of the signal arrived; False on timeout
        (generous by default: a loaded machine is slow, and a condition met returns at once)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                reqs = [r for r in self.received if r.signal == signal]
                done = len(reqs) >= requests if spans is None else self._spans(reqs) >= spans
                if done:
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._lock.wait(left)

    @staticmethod
    def _spans(reqs: list[Received]) -> int:
        return sum(len(ss.spans) for r in reqs for rs in r.request.resource_spans for ss in rs.scope_spans)

    # -- behaviour ---------------------------------------------------------------------------

    def fail_next(self, count: int = 1, grpc_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE, http_status: int = 503, retry_after: str | None = None) -> None:
        """Answer the next ``count`` requests (any transport) with an error instead of storing them."""
        with self._lock:
            self._failures.append(_Failure(count, grpc_code, http_status, retry_after))

    def reject_next(self, count: int = 1, rejected: int = 1, message: str = "rejected by test") -> None:
        """Store the next ``count`` requests but answer with a partial success rejecting ``rejected`` items."""
        with self._lock:
            self._rejections.append((count, rejected, message))

    def _take_failure(self) -> _Failure | None:
        with self._lock:
            if not self._failures:
                return None
            f = self._failures[0]
            f.count -= 1
            if f.count <= 0:
                self._failures.pop(0)
            return f

    def _record(self, received: Received) -> Message:
        """Store the request; returns the response message (with any injected partial success)."""
        response = _RESPONSE[received.signal]()
        with self._lock:
            self.received.append(received)
            if self._rejections:
                left, rejected, message = self._rejections[0]
                setattr(response.partial_success, _REJECTED_FIELD[received.signal], rejected)
                response.partial_success.error_message = message
                if left <= 1:
                    self._rejections.pop(0)
                else:
                    self._rejections[0] = (left - 1, rejected, message)
            self._lock.notify_all()
        return response

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> OtlpReceiver:
        if self.running:
            return self
        self._start_grpc()
        self._start_http()
        return self

    def stop(self) -> None:
        """Kill both listeners now (no grace): in-flight calls fail, keep-alive connections drop."""
        if self._grpc_server is not None:
            self._grpc_server.stop(grace=None).wait(5)
            self._grpc_server = None
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            with self._lock:
                for conn in list(self._connections):
                    try:
                        conn.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    conn.close()
                self._connections.clear()
            if self._http_thread is not None:
                self._http_thread.join(5)
            self._http_server = None
            self._http_thread = None

    def restart(self) -> OtlpReceiver:
        self.stop()
        return self.start()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- gRPC --------------------------------------------------------------------------------

    def _start_grpc(self) -> None:
        receiver = self

        def handle(signal: str, request: Message, context: grpc.ServicerContext) -> Message:
            if receiver.delay_s:
                time.sleep(receiver.delay_s)
            failure = receiver._take_failure()
            metadata = {k.lower(): v for k, v in context.invocation_metadata() if isinstance(v, str)}
            if failure is not None:
                if failure.retry_after is not None:
                    context.set_trailing_metadata((("grpc-status-details-bin", failure.grpc_status_details()),))
                context.abort(failure.grpc_code, "failure injected by the test receiver")
            return receiver._record(
                Received(
                    signal,
                    "grpc",
                    request,
                    content_encoding=metadata.get("grpc-encoding", ""),
                    headers=metadata,
                    body_bytes=request.ByteSize(),
                )
            )

        class Traces(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - generated name
                return handle("traces", request, context)

        class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
            def Export(self, request, context):  # noqa: N802 - generated name
                return handle("metrics", request, context)

        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="otlp-rx-grpc"),
            options=[("grpc.max_receive_message_length", self.max_receive_bytes), ("grpc.so_reuseport", 1)],
        )
        if "traces" in self.signals:
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
        if "metrics" in self.signals:  # absent: gRPC itself answers UNIMPLEMENTED
            metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
        if self.tls:
            chain, key = (Path(p).read_bytes() for p in self.tls)
            port = server.add_secure_port(f"{self.host}:{self.grpc_port}", grpc.ssl_server_credentials([(key, chain)]))
        else:
            port = server.add_insecure_port(f"{self.host}:{self.grpc_port}")
        if not port or (self.grpc_port and port != self.grpc_port):
            raise OSError(f"test OTLP receiver could not bind gRPC port {self.host}:{self.grpc_port}")
        self.grpc_port = port
        server.start()
        self._grpc_server = server

    # -- HTTP --------------------------------------------------------------------------------

    def _start_http(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real exporters use it

            def setup(self) -> None:
                super().setup()
                with receiver._lock:
                    receiver._connections.add(self.connection)

            def finish(self) -> None:
                with receiver._lock:
                    receiver._connections.discard(self.connection)
                try:
                    super().finish()
                except OSError:
                    pass

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep test output quiet
                pass

            def _reply(self, status: int, body: bytes = b"", content_type: str = "text/plain", extra: dict[str, str] | None = None) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                signal = _HTTP_PATHS.get(path)
                if signal is None:
                    self._reply(404, b"unknown path")
                    return
                if signal not in receiver.signals:
                    receiver.refused.append(f"{signal}: not served")
                    self._reply(405, b"method not allowed")
                    return
                if len(raw) > receiver.max_receive_bytes:
                    receiver.refused.append(f"{signal}: {len(raw)} bytes")
                    self._reply(413, b"request entity too large")
                    return
                encoding = (self.headers.get("Content-Encoding") or "").strip().lower()
                ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
                try:
                    body = gzip.decompress(raw) if encoding == "gzip" else raw
                    if ctype == "application/x-protobuf":
                        request = _REQUEST[signal].FromString(body)
                    elif ctype == "application/json":
                        request = otlp_json_to_proto(body, _REQUEST[signal])
                    else:
                        self._reply(415, f"unsupported content type {ctype!r}".encode())
                        return
                except (OSError, EOFError, DecodeError, OtlpJsonError, orjson.JSONDecodeError) as exc:
                    self._reply(400, f"bad request body: {exc}".encode())
                    return
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                failure = receiver._take_failure()
                if failure is not None:
                    extra = {"Retry-After": failure.retry_after} if failure.retry_after is not None else None
                    self._reply(failure.http_status, b"failure injected by the test receiver", extra=extra)
                    return
                response = receiver._record(
                    Received(
                        signal,
                        "http",
                        request,
                        content_type=ctype,
                        content_encoding=encoding,
                        path=path,
                        headers={k.lower(): v for k, v in self.headers.items()},
                        body_bytes=len(body),
                    )
                )
                if ctype == "application/json":
                    out = json_format.MessageToJson(response, indent=None).encode()
                    self._reply(200, out, "application/json")
                else:
                    self._reply(200, response.SerializeToString(), "application/x-protobuf")

        receiver = self

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            allow_reuse_address = True
            block_on_close = False

            def handle_error(self, request, client_address) -> None:  # noqa: ANN001
                # A client that drops a request half-way (a deadline cut it, a job exited) is normal for a
                # collector: record it, as a collector logs it, instead of printing a traceback into
                # whatever test's captured stderr is current.
                receiver.http_errors.append(f"{client_address}: {sys.exc_info()[1]!r}")

        server = Server((self.host, self.http_port), Handler)
        if self.tls:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*map(str, self.tls))
            server.socket = ctx.wrap_socket(server.socket, server_side=True)
        self.http_port = server.server_address[1]
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="otlp-rx-http", daemon=True)
        thread.start()
        self._http_server = server
        self._http_thread = thread
