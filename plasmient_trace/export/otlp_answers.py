"""What an OTLP backend's answer asks of the sender: how long to wait before the next attempt (gRPC
RetryInfo, HTTP Retry-After, never below the jittered backoff), the one-line reason an error body gives,
and whether a port that dropped a plain request speaks TLS.

Hints are advisory: a malformed one reads as none, never as an error of the export.
"""

from __future__ import annotations

import math
import random
import socket
import ssl
import time
from typing import Any

import orjson


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
