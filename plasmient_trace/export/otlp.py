"""Send a SpanBatch over OTLP (gRPC, http/protobuf or http/json): the one client, its retries and its deadline.

How the exporter is configured (``OTEL_EXPORTER_OTLP_*``, endpoints, protocol and timeout defaults) and how
its secrets are kept out of messages is :mod:`.otlp_config`; its names are re-exported here.
``OTEL_EXPORTER_OTLP_TIMEOUT`` bounds each request *including* its retries, so a dead collector costs at
most that long before :class:`ExportError`.

Retryable failures (gRPC CANCELLED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, ABORTED, OUT_OF_RANGE,
UNAVAILABLE, DATA_LOSS; HTTP 429, 502, 503, 504; refused or dropped connections) are retried with
exponential backoff and jitter, honouring gRPC RetryInfo and HTTP Retry-After (never below the
backoff, and a hint past the deadline ends the export), until the timeout. The timeout is a deadline
for each request, retries and slow reads included: an HTTP answer still arriving at the deadline is
cut off by closing the socket. A backend that *answers* that it is busy (HTTP 429/503, gRPC
RESOURCE_EXHAUSTED, or any retryable answer with a retry hint) is alive and draining its queue, not
down: its requests get ``backpressure_s`` (``PLASMIENT_OTLP_BACKPRESSURE_S``, default 120 s) instead
of the timeout, and once it has pushed back the following requests are paced (each waits the last
hint, halved after every accepted request), so a slow backend (Phoenix) receives a whole trace.
Requests never exceed ``max_request_bytes`` (``PLASMIENT_OTLP_MAX_REQUEST_MIB``, default 3.5 MiB,
under the 4 MiB that Jaeger, Tempo and Collector receivers accept by default).
A signal the backend does not serve (gRPC UNIMPLEMENTED, HTTP 404/405) raises
:class:`UnsupportedSignal` at once: a traces-only backend is a configuration fact, not an outage.
Every error line names the signal and never shows header values or URL credentials (:func:`redact`).
:class:`OtlpClient` is signal-generic (traces, metrics) so the metrics exporter reuses it.
How a backend's retry hints and error bodies are read is :mod:`.otlp_answers`.
"""

from __future__ import annotations

import gzip
import http.client
import socket
import threading
import logging
import math
import os
import ssl
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from plasmient_trace.conventions import SpanBatch
from plasmient_trace.export.otlp_json import encode_jsonl_lines, package_version
from plasmient_trace.export.otlp_answers import (
    NOT_TLS_HINT,
    TLS_PORT_HINT,
    TLS_PROBE_S,
    TOO_LARGE_HINT,
    UNTRUSTED_HINT,
    WRONG_PROTOCOL_HINT,
    backoff_wait,
    doubled_path_hint,
    grpc_retry_delay,
    host_port,
    http_error_detail,
    ignored_headers_note,
    looks_like_http2,
    one_line,
    partial_success_json,
    partial_success_proto,
    printable,
    retry_after,
    speaks_tls,
)
from plasmient_trace.export.otlp_config import DEFAULT_PROTOCOL, PROTOCOLS, OtlpConfig, parse_headers, redact, redact_url
from plasmient_trace.export.otlp_proto import encode_requests

__all__ = ["PROTOCOLS", "DEFAULT_PROTOCOL", "ExportError", "UnsupportedSignal", "OtlpConfig", "ExportStats", "OtlpClient", "export_spans", "send_spans",
           "parse_headers", "redact", "redact_url", "backoff_wait"]

log = logging.getLogger(__name__)

_RETRYABLE_HTTP = frozenset({429, 502, 503, 504})
_BUSY_HTTP = frozenset({429, 503})  # answered by a live server that asks the sender to slow down
_UNSUPPORTED_HTTP = frozenset({404, 405})  # no handler for this signal's path
_STOP_POLL_S = 0.05  # how often an in-flight request looks at its stop event
_GZIP_LEVEL = 5  # gzip -5: most of -9's ratio on OTLP payloads at a fraction of its CPU time

# gRPC service and response message per signal.
_SERVICES = {
    "traces": ("opentelemetry.proto.collector.trace.v1.TraceService", "opentelemetry.proto.collector.trace.v1.trace_service_pb2", "ExportTraceServiceResponse"),
    "metrics": ("opentelemetry.proto.collector.metrics.v1.MetricsService", "opentelemetry.proto.collector.metrics.v1.metrics_service_pb2", "ExportMetricsServiceResponse"),
    "logs": ("opentelemetry.proto.collector.logs.v1.LogsService", "opentelemetry.proto.collector.logs.v1.logs_service_pb2", "ExportLogsServiceResponse"),
}


class ExportError(RuntimeError):
    """An OTLP export failed for good: one line naming signal, endpoint, protocol and what happened.
    ``retried_out``: attempts that could have succeeded (a collector down, busy or slow) used up the
    request's budget, which the collector's other signals would too."""

    def __init__(self, message: str, retried_out: bool = False) -> None:
        super().__init__(message)
        self.retried_out = retried_out
        self.unsent: SpanBatch | None = None  # export_spans: the spans of the traces not wholly delivered
        self.requests = 0  # export_spans: the batch's requests that went through before the failure


class UnsupportedSignal(ExportError):
    """The backend answered that it does not serve this signal (e.g. a traces-only backend asked for metrics)."""


# --------------------------------------------------------------------------------------------
# Transport
# --------------------------------------------------------------------------------------------


@dataclass
class ExportStats:
    """What one send_spans call did."""

    endpoint: str
    protocol: str
    spans: int = 0
    requests: int = 0
    bytes: int = 0  # serialized request bytes before compression
    bytes_sent: int = 0  # request bodies as sent (after gzip)
    retries: int = 0
    rejected: int = 0  # partial_success.rejected_spans summed over requests
    messages: list[str] = field(default_factory=list)  # partial_success error messages
    seconds: float = 0.0


class _Retry(Exception):
    def __init__(self, what: str, after_s: float | None = None, busy: bool = False, unreachable: bool = False) -> None:
        super().__init__(what)
        self.what = what
        self.after_s = after_s
        self.unreachable = unreachable  # no server answered at all
        # The server answered and asked to slow down (it is alive): the backpressure budget applies.
        self.busy = busy or after_s is not None


class _Fail(Exception):
    pass


class _Unsupported(_Fail):
    pass


class OtlpClient:
    """One connection (gRPC channel or HTTP keep-alive connection) to an OTLP endpoint.

    ``export(body)`` sends one serialized request (protobuf, or OTLP/JSON for http/json) with
    retries inside ``config.timeout_s`` and returns (rejected count, partial-success message).
    """

    def __init__(self, config: OtlpConfig) -> None:
        self.config = config
        self.attempts = 0
        service, module, response = _SERVICES[config.signal]
        self._method_path = f"/{service}/Export"
        self._response_module = module
        self._response_name = response
        self._channel: Any = None
        self._grpc_call: Any = None
        self._conn: http.client.HTTPConnection | None = None
        self._user_agent = f"plasmient-trace/{package_version()}"
        self.last_sent_bytes = 0
        self.pace_s = 0.0  # wait before the next request, set by a backend that pushed back
        # a plain-text endpoint's (host, port, named with http://), asked once whether it speaks TLS
        # when it drops a request; None: nothing to ask (TLS already, a unix socket, asked before)
        self._plain_port: tuple[str, int, bool] | None = None
        self._headers = config.request_headers
        if config.protocol == "grpc":
            self._open_grpc()
        else:
            url = urllib.parse.urlsplit(config.endpoint)
            if url.scheme not in ("http", "https") or not url.hostname:
                raise ValueError(f"OTLP/HTTP endpoint {config.endpoint!r} must be an http:// or https:// URL")
            self._url = url
            self._path = (url.path or "/") + (f"?{url.query}" if url.query else "")
            if url.scheme == "http":
                self._plain_port = host_port(url.netloc, True)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> OtlpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the retry loop (the only one: Delivery, send_spans, send_metrics and replay all use it) --

    def export(self, body: bytes, deadline: float | None = None, stop: threading.Event | None = None,
               max_attempts: int | None = None) -> tuple[int, str]:
        """Send one serialized request, retrying transient failures (at most ``max_attempts`` tries: one for a
        probe of a collector known to be down) until ``deadline`` (a
        ``time.monotonic()`` value; default now + ``config.timeout_s``, extended to now +
        ``config.backpressure_s`` while the backend answers that it is busy, never past a deadline the
        caller gave). The deadline bounds the whole call, retries and slow reads included; ``stop`` (set by a shutdown) ends a backoff wait or an
        in-flight request at once. Raises :class:`ExportError` naming the endpoint with secrets redacted."""
        cfg = self.config
        # gRPC compresses on the wire itself (grpc-encoding: gzip); HTTP sends a gzip body.
        http_gzip = cfg.compression == "gzip" and cfg.protocol != "grpc"
        payload = gzip.compress(body, compresslevel=_GZIP_LEVEL) if http_gzip else body
        self.last_sent_bytes = len(payload)
        stop = stop or threading.Event()
        if self.pace_s > 0 and stop.wait(self.pace_s):  # the backend pushed back on an earlier request
            raise ExportError(self._describe("stopped by shutdown", 0, time.monotonic()))
        start = time.monotonic()
        caller = math.inf if deadline is None else deadline
        deadline = min(caller, start + cfg.timeout_s)
        delay = cfg.retry_initial_s
        attempts = 0
        while True:
            attempts += 1
            self.attempts += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0 or stop.is_set():
                why = "stopped by shutdown" if stop.is_set() else "export deadline passed"
                raise ExportError(self._describe(why, attempts - 1, start), retried_out=attempts > 1)
            try:
                if cfg.protocol == "grpc":
                    answer = self._grpc_attempt(payload, min(remaining, cfg.timeout_s), stop)
                else:
                    answer = self._http_attempt(payload, min(remaining, cfg.timeout_s), stop)
                self.pace_s = self.pace_s / 2 if self.pace_s > 0.05 else 0.0  # speed up again as the backend keeps up
                return answer
            except _Unsupported as exc:
                raise UnsupportedSignal(self._describe(str(exc), attempts, start)) from None
            except _Fail as exc:
                raise ExportError(self._describe(str(exc), attempts, start)) from None
            except _Retry as exc:
                if max_attempts is not None and attempts >= max_attempts:
                    raise ExportError(self._describe(exc.what, attempts, start), retried_out=True) from None
                if exc.busy:
                    # Alive and busy: wait for it up to the backpressure budget, each attempt still
                    # bounded by the timeout, and pace the requests that follow.
                    deadline = max(deadline, min(caller, start + cfg.backpressure_s))
                wait = backoff_wait(exc.after_s, delay, cfg.retry_max_s)
                delay = min(delay * 2, cfg.retry_max_s)
                if exc.after_s is not None and math.isfinite(exc.after_s):
                    # The server's own estimate of when it can take more: the next requests wait that long.
                    self.pace_s = max(self.pace_s, min(exc.after_s, cfg.retry_max_s))
                if time.monotonic() + wait >= deadline:
                    what = exc.what if exc.after_s is None or wait != exc.after_s else \
                        f"{exc.what} (asked to retry after {exc.after_s:g}s, past the deadline)"
                    raise ExportError(self._describe(what, attempts, start), retried_out=True) from None
                log.debug("OTLP export to %s: %s; retrying in %.2fs", self.display_endpoint, redact(exc.what, cfg), wait)
                if stop.wait(wait):
                    raise ExportError(self._describe(f"{exc.what}; stopped by shutdown", attempts, start),
                                      retried_out=exc.unreachable) from None

    @property
    def display_endpoint(self) -> str:
        return redact_url(self.config.endpoint)

    def _describe(self, what: str, attempts: int, start: float) -> str:
        cfg = self.config
        return redact(one_line(
            f"OTLP export to {self.display_endpoint} ({cfg.protocol}) failed for {cfg.signal}: {what} "
            f"[{attempts} attempt{'s' if attempts != 1 else ''} in {time.monotonic() - start:.1f}s, timeout {cfg.timeout_s:g}s]"
            + doubled_path_hint(cfg)
            + ignored_headers_note(cfg.ignored_headers)
        ), cfg)

    def _partial(self, response_bytes: bytes) -> tuple[int, str]:
        return partial_success_proto(self._response_module, self._response_name, response_bytes)

    # -- gRPC --------------------------------------------------------------------------------

    def _open_grpc(self) -> None:
        if "grpc" not in sys.modules:
            # gRPC's core logs a failed TLS handshake (and more) at INFO to the process's stderr, the
            # traced job's; the failure reaches the user as our one line instead. Its documented default,
            # unless the job chose a level (or imported gRPC first, and with it its own settings).
            os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
        import grpc

        cfg = self.config
        endpoint = cfg.endpoint.strip()
        if "://" in endpoint:
            parts = urllib.parse.urlsplit(endpoint)
            if parts.scheme in ("http", "https"):
                # the credentials travel as a header (OtlpConfig.request_headers), never in the target
                target, secure = parts.netloc.rsplit("@", 1)[-1], parts.scheme == "https"
            else:  # unix:, dns:, ... : a gRPC target as is
                target, secure = endpoint, not cfg.insecure
        else:
            target, secure = endpoint, not cfg.insecure
        if not target:
            raise ValueError(f"OTLP/gRPC endpoint {cfg.endpoint!r} has no host")
        options = [
            ("grpc.enable_retries", 0),  # retries are ours, bounded by the timeout
            # A collector that restarts is found again within a second, not after gRPC's 2-minute cap.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.max_send_message_length", -1),
            ("grpc.max_receive_message_length", 16 * 1024 * 1024),
            ("grpc.primary_user_agent", self._user_agent),
        ]
        if secure:

            def read(path: str | None) -> bytes | None:
                if not path:
                    return None
                with open(path, "rb") as f:
                    return f.read()

            creds = grpc.ssl_channel_credentials(
                root_certificates=read(cfg.certificate),
                private_key=read(cfg.client_key),
                certificate_chain=read(cfg.client_certificate),
            )
            self._channel = grpc.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
            self._plain_port = host_port(target, "://" in endpoint)
        # Bytes in, bytes out: the request is already serialized.
        self._grpc_call = self._channel.unary_unary(self._method_path, request_serializer=None, response_deserializer=None)
        self._metadata = tuple(self._headers.items())

    def _grpc_attempt(self, payload: bytes, timeout: float, stop: threading.Event) -> tuple[int, str]:
        import grpc

        compression = grpc.Compression.Gzip if self.config.compression == "gzip" else None
        try:
            # gRPC's timeout is a deadline for the whole call; the future lets a shutdown cancel it.
            future = self._grpc_call.future(payload, timeout=timeout, metadata=self._metadata, compression=compression)
            done = threading.Event()
            future.add_done_callback(lambda _f: done.set())
            while not done.wait(_STOP_POLL_S):
                if stop.is_set():
                    future.cancel()
                    break
            response = future.result()
        except grpc.FutureCancelledError:
            raise _Fail("stopped by shutdown") from None
        except ValueError as exc:  # metadata gRPC refuses
            raise _Fail(f"invalid request metadata: {type(exc).__name__}") from None
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            what = f"{code.name if code else 'UNKNOWN'}: {details}"
            if "Expected SETTINGS frame" in str(details):
                # an HTTP/1.1 server answered the gRPC client: a protocol mix-up, not an outage
                raise _Fail(f"{what}{WRONG_PROTOCOL_HINT['grpc']}") from None
            if "CERTIFICATE_VERIFY_FAILED" in str(details):
                raise _Fail(f"{what}{UNTRUSTED_HINT}") from None
            if "WRONG_VERSION_NUMBER" in str(details):
                raise _Fail(f"{what}{NOT_TLS_HINT}") from None
            retryable = {
                grpc.StatusCode.CANCELLED,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                grpc.StatusCode.ABORTED,
                grpc.StatusCode.OUT_OF_RANGE,
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DATA_LOSS,
            }
            if code == grpc.StatusCode.UNAVAILABLE and ("Socket closed" in str(details) or "reset" in str(details)):
                hint = self._tls_port_hint(timeout)
                if hint:
                    raise _Fail(f"{what}{hint}") from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in str(details):
                # The receiver's size limit, not a full queue: the same request will never fit.
                raise _Fail(f"{what}{TOO_LARGE_HINT}") from None
            if code in retryable:
                raise _Retry(what, grpc_retry_delay(exc), busy=code == grpc.StatusCode.RESOURCE_EXHAUSTED,
                             unreachable=code == grpc.StatusCode.UNAVAILABLE) from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise _Unsupported(what) from None
            raise _Fail(what) from None
        return self._partial(response)

    def _tls_port_hint(self, timeout: float) -> str:
        """The hint for a plain-text request the endpoint dropped, if it did so because it speaks TLS
        (asked once per client; a collector that is down is asked nothing more)."""
        plain, self._plain_port = self._plain_port, None
        if plain is None:
            return ""
        host, port, named_http = plain
        return TLS_PORT_HINT[named_http] if speaks_tls(host, port, min(timeout, TLS_PROBE_S)) else ""

    # -- HTTP --------------------------------------------------------------------------------

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        if self._conn is None:
            url, cfg = self._url, self.config
            if url.scheme == "https":
                ctx = ssl.create_default_context(cafile=cfg.certificate)
                if cfg.client_certificate:
                    ctx.load_cert_chain(cfg.client_certificate, cfg.client_key)
                self._conn = http.client.HTTPSConnection(url.hostname, url.port, timeout=timeout, context=ctx)
            else:
                self._conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
        else:
            self._conn.timeout = timeout
            if self._conn.sock is not None:
                self._conn.sock.settimeout(timeout)
        return self._conn

    def _abort_http(self) -> None:
        """Shut the socket under a blocked request: a collector that answers one byte a second keeps
        every socket timeout happy, so the deadline is enforced from outside."""
        conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _http_attempt(self, payload: bytes, timeout: float, stop: threading.Event) -> tuple[int, str]:
        cfg = self.config
        json_body = cfg.protocol == "http/json"
        headers = {
            "Content-Type": "application/json" if json_body else "application/x-protobuf",
            "User-Agent": self._user_agent,
            **self._headers,
        }
        if cfg.compression == "gzip":
            headers["Content-Encoding"] = "gzip"
        watchdog = _Watchdog(timeout, stop, self._abort_http)
        try:
            conn = self._connection(timeout)
            conn.request("POST", self._path, body=payload, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException, ValueError) as exc:
            watchdog.cancel()
            if isinstance(exc, ssl.SSLCertVerificationError):  # (a ValueError too)
                raise _Fail(f"{type(exc).__name__}: {exc.verify_message or exc}{UNTRUSTED_HINT}") from None
            if isinstance(exc, ssl.SSLError) and not isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
                # a TLS mismatch (a plain-HTTP port, a protocol version) is the same at every attempt
                hint = NOT_TLS_HINT if "WRONG_VERSION_NUMBER" in str(exc) else ""
                raise _Fail(f"{type(exc).__name__}: {printable(str(exc))}{hint}") from None
            if isinstance(exc, ValueError):  # http.client refuses a header value (e.g. a newline)
                raise _Fail(f"invalid request: {type(exc).__name__}") from None
            # Refused, reset, timed out or a half-closed keep-alive connection: reconnect and retry.
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            if isinstance(exc, http.client.BadStatusLine) and looks_like_http2(str(exc)):
                # an HTTP/2 (gRPC) server answered with its SETTINGS frame: a protocol mix-up, not an outage
                raise _Fail(f"{type(exc).__name__}: an HTTP/2 frame, not an HTTP/1.1 status line"
                            f"{WRONG_PROTOCOL_HINT['http']}") from None
            what = f"{type(exc).__name__}: {printable(str(exc))}" if str(exc) else type(exc).__name__
            if isinstance(exc, (ConnectionResetError, http.client.RemoteDisconnected, http.client.BadStatusLine)) \
                    and not watchdog.fired:
                hint = self._tls_port_hint(timeout)
                if hint:
                    raise _Fail(f"{what}{hint}") from None
            if watchdog.fired:
                what = "stopped by shutdown" if stop.is_set() else f"timed out: no complete answer within the deadline ({what})"
                raise _Fail(what) from None
            raise _Retry(what, unreachable=True) from None
        watchdog.cancel()
        status = resp.status
        if resp.getheader("Connection", "").lower() == "close" and self._conn is not None:
            self._conn.close()
            self._conn = None
        if 200 <= status < 300:
            if json_body:
                return self._partial_json(data)
            ctype = resp.getheader("Content-Type", "")
            return self._partial_json(data) if "json" in ctype else self._partial(data)
        what = f"HTTP {status} {resp.reason}{http_error_detail(data, resp.getheader('Content-Type', ''))}"
        if 300 <= status < 400 and resp.getheader("Location"):
            # not followed: the spans and the auth headers would go to a host nobody named
            what += (f" to {redact_url(printable(resp.getheader('Location')))}: name that endpoint (an OTLP "
                     "exporter does not follow redirects)")
        if status in _RETRYABLE_HTTP:
            raise _Retry(what, retry_after(resp.getheader("Retry-After")), busy=status in _BUSY_HTTP)
        if status in _UNSUPPORTED_HTTP:
            raise _Unsupported(what)
        raise _Fail(f"{what}{TOO_LARGE_HINT}" if status == 413 else what)

    def _partial_json(self, data: bytes) -> tuple[int, str]:
        return partial_success_json(self.config.signal, data)


class _Watchdog:
    """Calls ``abort`` once the attempt's time is up or ``stop`` is set, unless cancelled first."""

    def __init__(self, timeout: float, stop: threading.Event, abort: Callable[[], None]) -> None:
        self.fired = False
        self._done = threading.Event()
        self._abort = abort
        self._thread = threading.Thread(target=self._run, args=(time.monotonic() + timeout, stop), daemon=True,
                                        name="plasmient-otlp-watchdog")
        self._thread.start()

    def _run(self, deadline: float, stop: threading.Event) -> None:
        while not self._done.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or stop.is_set():
                self.fired = True
                self._abort()
                return
            self._done.wait(min(left, _STOP_POLL_S))

    def cancel(self) -> None:
        self._done.set()


# --------------------------------------------------------------------------------------------
# send_spans
# --------------------------------------------------------------------------------------------


def _payloads(batch: SpanBatch, config: OtlpConfig, traces: list[bytes]) -> Iterable[bytes]:
    if config.protocol == "http/json":
        for line in encode_jsonl_lines(batch, max_bytes=config.max_request_bytes, traces=traces):
            yield line.rstrip(b"\n")
    else:
        yield from encode_requests(batch, max_bytes=config.max_request_bytes, traces=traces)


def _not_delivered(batch: SpanBatch, traces: list[bytes], sent: int) -> SpanBatch:
    """The spans of ``batch`` in traces not all of whose requests went through (the first ``sent`` of the
    requests whose trace ids ``traces`` lists did)."""
    cut = traces[sent] if sent < len(traces) else None   # the failed request's trace: resent whole
    delivered = set(traces[:sent]) - {cut}
    if not delivered:
        return batch
    keep = pc.invert(pc.is_in(batch.table.column("trace_id"), value_set=pa.array(list(delivered), pa.binary(16))))
    return SpanBatch(table=batch.table.filter(keep), resources=batch.resources, summaries=batch.summaries)


def export_spans(client: OtlpClient, batch: SpanBatch, stop: threading.Event | None = None,
                 max_attempts: int | None = None, skip_requests: int = 0,
                 on_request: Callable[[int], None] | None = None) -> ExportStats:
    """Export every span of the batch over an open client; raises ExportError when a request cannot be
    delivered within the timeout (each request has its own deadline, retries and slow reads included;
    ``max_attempts`` as in :meth:`OtlpClient.export`).

    Requests go one after another (one per trace, split at ``config.max_request_bytes``); the first
    that fails for good stops the export, and its ExportError's ``unsent`` holds the spans of the traces
    not wholly delivered (what to spill: a collector that failed after taking some traces got them twice
    on replay). Partial-success rejections are counted in the stats and logged, not raised: the collector
    accepted the request. ``skip_requests``: that many of the batch's first requests went through before
    (a replay resuming inside a line); ``on_request(k)`` is told, before the batch's request k + 1 is sent,
    that its first k went through (not before a batch's first or only request).
    """
    config = client.config
    stats = ExportStats(endpoint=client.display_endpoint, protocol=config.protocol, spans=len(batch))
    start = time.monotonic()
    attempts0 = client.attempts
    traces: list[bytes] = []  # the trace id of each request, as it is encoded
    for index, body in enumerate(_payloads(batch, config, traces)):
        if index < skip_requests:
            continue
        if index and on_request is not None:
            on_request(index)
        try:
            rejected, message = client.export(body, stop=stop, max_attempts=max_attempts)
        except ExportError as err:
            err.unsent = _not_delivered(batch, traces, index)
            err.requests = stats.requests
            raise
        stats.requests += 1
        stats.bytes += len(body)
        stats.bytes_sent += client.last_sent_bytes
        if rejected or message:
            stats.rejected += rejected
            stats.messages.append(message)
            log.warning("plasmient: OTLP endpoint %s rejected %d span(s): %s", stats.endpoint, rejected, message or "(no message)")
    stats.retries = client.attempts - attempts0 - stats.requests
    stats.seconds = time.monotonic() - start
    return stats


def send_spans(batch: SpanBatch, config: OtlpConfig | None = None) -> ExportStats:
    """:func:`export_spans` over a client of its own (one-off sends: tests, scripts)."""
    with OtlpClient(config or OtlpConfig.from_env()) as client:
        return export_spans(client, batch)
