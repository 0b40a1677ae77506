"""What an OTLP backend's answer asks of the sender, and what a failure means: how long to wait before the
next attempt (gRPC RetryInfo, HTTP Retry-After, never below the jittered backoff), the one-line reason an
error body gives, whether a port that dropped a plain request speaks TLS, and the hint each configuration
mistake gets (the other transport's port, TLS either way, a doubled /v1/traces, a request too large).

Hints are advisory: a malformed one reads as none, never as an error of the export.
"""

from __future__ import annotations

import math
import random
import re
import socket
import ssl
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from plasmient_trace.export.otlp_config import OtlpConfig


def one_line(text: str) -> str:
    """``text`` with every run of whitespace, newlines included, as one space: an error line stays one line."""
    return " ".join(str(text).split())


def grpc_retry_delay(exc: Any) -> float | None:
    """RetryInfo.retry_delay from the status details of a gRPC error, if the server sent one."""
    try:
        from google.rpc import error_details_pb2, status_pb2

        for key, value in exc.trailing_metadata() or ():
            if key == "grpc-status-details-bin":
                status = status_pb2.Status.FromString(value)
                for detail in status.details:
                    if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                        info = error_details_pb2.RetryInfo()
                        detail.Unpack(info)
                        return info.retry_delay.seconds + info.retry_delay.nanos / 1e9
    except Exception:  # details are advisory; a malformed one must not break the retry loop
        return None
    return None


def backoff_wait(after_s: float | None, delay_s: float, max_s: float) -> float:
    """How long to wait before the next attempt. Without a server hint: ``delay_s`` with +-20% jitter.
    A hint (Retry-After, RetryInfo) is honoured but never below the backoff (``Retry-After: 0``
    must not become a request storm); a hint beyond the deadline ends the export instead of waiting."""
    jittered = delay_s * random.uniform(0.8, 1.2)
    if after_s is None:
        return min(jittered, max_s)
    return max(after_s, jittered) if math.isfinite(after_s) else math.inf


def retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        from email.utils import parsedate_to_datetime

        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except Exception:
        return None


def http_error_detail(data: bytes, content_type: str) -> str:
    """': <message>' from an OTLP error body (google.rpc.Status, protobuf or JSON), else a text snippet."""
    if not data:
        return ""
    message = ""
    try:
        if "protobuf" in content_type:
            from google.rpc import status_pb2

            message = status_pb2.Status.FromString(data).message
        elif "json" in content_type:
            doc = orjson.loads(data)
            message = str(doc.get("message", "")) if isinstance(doc, dict) else ""
    except Exception:
        message = ""
    if not message:
        message = data[:200].decode("utf-8", "replace")
    return f": {one_line(message)}"


def speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether the server at host:port completes a TLS handshake, or refuses one with a TLS alert: a TLS port
    drops a plain-text request without a word (a reset, a closed socket), as a collector that is down
    does, and retrying never helps. Nothing is sent but the handshake, and no certificate is judged: this
    asks what the port speaks, not whether to trust it."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock, ctx.wrap_socket(sock, server_hostname=host):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc.reason or "")  # e.g. TLSV13_ALERT_CERTIFICATE_REQUIRED: TLS, wanting a client certificate
    except (OSError, ValueError):
        return False


TOO_LARGE_HINT = " (the request is larger than the backend accepts: lower PLASMIENT_OTLP_MAX_REQUEST_MIB)"

# What to do when the endpoint speaks the other OTLP transport (by default the Collector takes gRPC on 4317
# and HTTP on 4318, and the two are easily swapped).
WRONG_PROTOCOL_HINT = {
    "grpc": "; the endpoint answers in HTTP/1.1, not gRPC: if it is an OTLP/HTTP port (4318 by default), set "
            "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf, or name the gRPC port (4317)",
    "http": "; the endpoint answers in gRPC (HTTP/2): if it is an OTLP/gRPC port (4317 by default), set "
            "OTEL_EXPORTER_OTLP_PROTOCOL=grpc, or name the HTTP port (4318)",
}

NOT_TLS_HINT = "; the endpoint does not speak TLS: name it with http://, not https://"
TLS_PORT_HINT = {True: "; the endpoint speaks TLS: name it with https://, not http://",
                 False: "; the endpoint speaks TLS: unset OTEL_EXPORTER_OTLP_INSECURE (or name it with https://)"}
TLS_PROBE_S = 2.0  # at most this long to ask a port that dropped a plain request whether it speaks TLS
UNTRUSTED_HINT = ("; the collector's certificate is not signed by a CA this process trusts: set "
                  "OTEL_EXPORTER_OTLP_CERTIFICATE to the PEM file of the CA that signed it")


def looks_like_http2(status_line: str) -> bool:
    """Whether what came back instead of an HTTP/1.1 status line is an HTTP/2 frame header (a length, then
    type 4 = SETTINGS, which a gRPC server sends first): http.client reports it as the line it read."""
    raw = status_line.encode("latin-1", "replace").lstrip(b"'\"")
    return len(raw) >= 4 and raw[3:4] == b"\x04" and not raw.startswith(b"HTTP/")


def host_port(netloc: str, named_http: bool) -> tuple[str, int, bool] | None:
    """(host, port, named_http) of a host:port or [v6]:port; None when it is no such thing."""
    host, sep, port = netloc.rpartition("@")[2].rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port), named_http


def printable(text: str) -> str:
    """Text a server sent, with the bytes a terminal would misread (control characters, binary) escaped."""
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in text)[:200]


def ignored_headers_note(count: int) -> str:
    """Why a collector may have refused the request: header entries that were not sent (never their text)."""
    if not count:
        return ""
    one = count == 1
    return (f"; {count} entr{'y' if one else 'ies'} of OTEL_EXPORTER_OTLP_HEADERS had no key=value and "
            f"{'was' if one else 'were'} not sent")


def doubled_path_hint(cfg: OtlpConfig) -> str:
    """What went wrong when OTEL_EXPORTER_OTLP_ENDPOINT held a signal's full URL: the spec makes it the
    base, so ``/v1/<signal>`` was appended to the ``/v1/traces`` it ended with (as every OTel SDK does)."""
    if not (cfg.generic_endpoint and cfg.protocol.startswith("http")):
        return ""
    base = urllib.parse.urlsplit(cfg.generic_endpoint).path.rstrip("/")
    derived = urllib.parse.urlsplit(cfg.endpoint).path == f"{base}/v1/{cfg.signal}"  # not a signal's own URL
    if not (derived and re.search(r"/v1/(traces|metrics|logs)$", base)):
        return ""
    return ("; OTEL_EXPORTER_OTLP_ENDPOINT is the collector's base URL, to which /v1/<signal> is appended: drop the "
            f"/v1/... from it, or give the full URL as OTEL_EXPORTER_OTLP_{cfg.signal.upper()}_ENDPOINT")


# Field of PartialSuccess holding the rejected count, in OTLP/JSON spelling.
_REJECTED_JSON = {"traces": "rejectedSpans", "metrics": "rejectedDataPoints", "logs": "rejectedLogRecords"}


def partial_success_proto(module: str, message: str, response_bytes: bytes) -> tuple[int, str]:
    """(rejected count, error message) of a protobuf Export*ServiceResponse (``message`` in ``module``)."""
    import importlib

    from google.protobuf.message import DecodeError

    cls = getattr(importlib.import_module(module), message)
    try:
        resp = cls.FromString(response_bytes or b"")
    except DecodeError:
        # a 200 whose body is no OTLP response (a proxy's page): taken, with nothing said about
        # partial success, as the JSON answer is read
        return 0, ""
    ps = resp.partial_success
    rejected = next((v for f, v in ps.ListFields() if f.name.startswith("rejected_")), 0)
    return int(rejected), ps.error_message


def partial_success_json(signal: str, data: bytes) -> tuple[int, str]:
    """(rejected count, error message) of an OTLP/JSON answer; an empty or foreign body rejects nothing."""
    if not data.strip():
        return 0, ""
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return 0, ""
    if not isinstance(doc, dict):
        return 0, ""
    ps = doc.get("partialSuccess") or doc.get("partial_success") or {}
    rejected = ps.get(_REJECTED_JSON[signal]) or 0
    return int(rejected), str(ps.get("errorMessage") or "")
