"""OTLP exporter configuration, read like every OTel SDK reads it, and the redaction of its secrets.

Configuration follows the OTLP exporter spec's ``OTEL_EXPORTER_OTLP_*`` variables, signal-specific
ones (``OTEL_EXPORTER_OTLP_TRACES_*``) taking precedence over the generic ones, explicit arguments
over both. Choices where the spec leaves room, and why:

* protocol default is ``grpc``: the spec says SDKs SHOULD default to http/protobuf unless they
  have a reason, and the Python SDK (whose ``otlp`` entry point is the gRPC exporter) keeps grpc;
  matching it means one set of variables configures a process's other telemetry and ours alike.
* ``OTEL_EXPORTER_OTLP_TIMEOUT`` is read in milliseconds, as the spec says (the Python SDK reads
  seconds, a known deviation: opentelemetry-python#4044).
* HTTP endpoints: the generic endpoint gets ``v1/<signal>`` appended to its path; the signal
  endpoint is used as is (an empty path becomes ``/``). gRPC endpoints are targets; an ``http``
  scheme means plaintext, ``https`` TLS, no scheme means ``OTEL_EXPORTER_OTLP_INSECURE`` decides.

Every error line of the exporters goes through :func:`redact`: header values and URL credentials are
never printed.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from plasmient_trace.export.otlp_proto import DEFAULT_MAX_REQUEST_BYTES

__all__ = ["PROTOCOLS", "SIGNALS", "DEFAULT_PROTOCOL", "DEFAULT_TIMEOUT_S", "DEFAULT_BACKPRESSURE_S", "OtlpConfig",
           "parse_headers", "redact", "redact_url"]

log = logging.getLogger("plasmient_trace.export.otlp")

PROTOCOLS = ("grpc", "http/protobuf", "http/json")
SIGNALS = ("traces", "metrics", "logs")
DEFAULT_PROTOCOL = "grpc"
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_BACKPRESSURE_S = 120.0
_DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
_DEFAULT_HTTP_ENDPOINT = "http://localhost:4318"
# user:password@ after a scheme, up to the last '@' of the URL (a password may hold an unescaped '/', '#' or
# '@', which ends the URL's authority early for its parser but not for whoever reads the line), or with no
# scheme (a gRPC target, user:password@host:port)
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^\s'\"]*@")
_BARE_USERINFO = re.compile(r"(?<![\w.+/:@-])[\w.%+~-]+:(?!//)[^\s'\"]*@(?=[\w.\[\]-])")


# Header names each protocol can carry: gRPC metadata keys (lower case, digits, '-', '_', '.'), and HTTP's
# tokens (RFC 9110 5.6.2).
_GRPC_HEADER_KEY = re.compile(r"[0-9a-z_.-]+")
_HTTP_HEADER_KEY = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def parse_headers(value: str) -> dict[str, str]:
    """Parse ``OTEL_EXPORTER_OTLP_HEADERS``: comma-separated ``key=value``, values percent-decoded.

    Keys are lower-cased (gRPC metadata requires it; HTTP headers are case-insensitive). Entries
    without '=' or with an empty key are skipped with a warning, as the spec allows.
    """
    headers, ignored = _split_headers(value)
    if ignored:
        # never the entry itself: "Authorization Bearer <token>" is the usual one
        log.warning("plasmient: ignoring %d OTLP header entr%s without key=value (not shown: it may hold a secret)",
                    ignored, "y" if ignored == 1 else "ies")
    return headers


def malformed_header_entries(value: str) -> int:
    """Entries of an ``OTEL_EXPORTER_OTLP_HEADERS`` value that are not ``key=value`` (and are not sent)."""
    return _split_headers(value)[1]


def _split_headers(value: str) -> tuple[dict[str, str], int]:
    """The ``key=value`` entries (keys lower-cased, both percent-decoded) and how many others there were."""
    headers: dict[str, str] = {}
    ignored = 0
    for item in value.split(","):
        if not item.strip():
            continue
        key, sep, val = item.partition("=")
        key = urllib.parse.unquote(key).strip().lower()
        if not sep or not key:
            ignored += 1
            continue
        headers[key] = urllib.parse.unquote(val).strip()
    return headers, ignored


def _parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off", ""):
        return False
    raise ValueError(f"{name}={value!r}: expected true or false")


def _env_number(env: Mapping[str, str], name: str) -> float | None:
    """A positive finite number from the environment, None when unset; ValueError naming the variable."""
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={text!r}: expected a positive number")
    return value


def _pem_file(source: str, path: str) -> str:
    """``path`` when it is a readable PEM file; else ValueError naming the variable: a TLS file that is
    missing or not PEM fails every export the same way, so it is said once, before any is tried."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
    except OSError as err:
        raise ValueError(f"{source}={path!r}: {err.strerror or type(err).__name__}") from None
    if b"-----BEGIN " not in head:
        raise ValueError(f"{source}={path!r}: not a PEM file (no '-----BEGIN' line)")
    return path


def _http_signal_url(base: str, signal: str) -> str:
    """Generic endpoint + ``v1/<signal>`` (spec: relative to the endpoint's path)."""
    parts = urllib.parse.urlsplit(base)
    path = parts.path.rstrip("/") + f"/v1/{signal}"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment))


def _as_is_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return url if parts.path else urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/", parts.query, parts.fragment))


def _signal_endpoint(generic: str | None, protocol: str, signal: str) -> str:
    if protocol.startswith("http"):
        return _http_signal_url(generic or _DEFAULT_HTTP_ENDPOINT, signal)
    return generic or _DEFAULT_GRPC_ENDPOINT


def _endpoint_problem(endpoint: str, protocol: str) -> str | None:
    """What makes ``endpoint`` unusable before any connection is tried (None: nothing). HTTP needs an
    http(s) URL with a host; gRPC takes other targets (unix:, dns:, host:port) as gRPC reads them."""
    text = endpoint.strip()
    if protocol == "grpc" and not text.startswith(("http://", "https://")):
        return None
    try:
        parts = urllib.parse.urlsplit(text)
        parts.port  # noqa: B018 - raises for a port out of range or not a number
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https"):
        return "not an http:// or https:// URL"
    if not parts.hostname:
        return "no host"
    return None


@dataclass(frozen=True)
class OtlpConfig:
    """Where and how to send OTLP. ``endpoint`` is final: a full URL for HTTP, a target URL for gRPC."""

    endpoint: str = _DEFAULT_GRPC_ENDPOINT
    protocol: str = DEFAULT_PROTOCOL
    headers: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = DEFAULT_TIMEOUT_S
    compression: str | None = None  # "gzip" or None
    insecure: bool = False  # gRPC only, for endpoints without http/https scheme
    certificate: str | None = None  # PEM file of trusted roots
    client_key: str | None = None
    client_certificate: str | None = None
    signal: str = "traces"
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    retry_initial_s: float = 0.5
    retry_max_s: float = 5.0
    # How long one request may wait on a backend that answers it is busy (429/503/RESOURCE_EXHAUSTED).
    backpressure_s: float = DEFAULT_BACKPRESSURE_S
    # True when the endpoint was configured (argument or environment), False when it is the default:
    # the CLI only sends when someone asked it to.
    explicit: bool = False
    # The generic endpoint (OTEL_EXPORTER_OTLP_ENDPOINT or the ``endpoint`` override), so the other
    # signals' URLs can be derived from the same configuration (see for_signal).
    generic_endpoint: str | None = None
    # Header entries that were not key=value and so were not sent: named on a failure (a 401 without them)
    ignored_headers: int = 0

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"OTLP protocol {self.protocol!r} is not one of {', '.join(PROTOCOLS)}")
        problem = _usable_problem(self.endpoint, self.protocol)
        if problem:
            # a mistake in the setting, not a collector that is down: said at once, nothing spilled for it
            raise ValueError(_without_userinfo(f"OTLP endpoint {redact_url(self.endpoint)!r} ({self.protocol}) is not "
                                               f"usable: {problem}", self.endpoint))
        if self.compression not in (None, "gzip"):
            raise ValueError(f"OTLP compression {self.compression!r} is not supported (gzip or none)")
        if self.signal not in SIGNALS:
            raise ValueError(f"OTLP signal {self.signal!r} is not one of {', '.join(SIGNALS)}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ValueError(f"OTLP timeout must be a positive number of seconds, got {self.timeout_s!r}")
        if not self.max_request_bytes >= 1024:
            raise ValueError(f"OTLP max request size must be at least 1 KiB, got {self.max_request_bytes!r} bytes")
        if not (self.backpressure_s > 0 and math.isfinite(self.backpressure_s)):
            raise ValueError(f"OTLP backpressure wait must be a positive number of seconds, got {self.backpressure_s!r}")
        for key, value in self.headers.items():
            legal = _GRPC_HEADER_KEY if self.protocol == "grpc" else _HTTP_HEADER_KEY
            if not legal.fullmatch(key):
                # gRPC's C core refused it only when sending, after logging its own lines on stderr (a job's, live)
                raise ValueError(f"OTLP header name {key!r} is not a valid {'gRPC metadata key' if self.protocol == 'grpc' else 'HTTP header name'}")
            if any(ord(c) < 0x20 or ord(c) == 0x7F for c in str(value)):
                # The value is a credential more often than not: name the header, never show it.
                raise ValueError(f"OTLP header {key!r} has a control character (newline?) in its value (value not shown)")

    def __repr__(self) -> str:
        shown = {k: "***" for k in self.headers}
        return f"OtlpConfig(endpoint={redact_url(self.endpoint)!r}, protocol={self.protocol!r}, headers={shown}, timeout_s={self.timeout_s:g})"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, signal: str = "traces", **overrides: Any) -> OtlpConfig:
        """Configuration from ``OTEL_EXPORTER_OTLP_*`` (``env`` defaults to os.environ), then overrides.

        Overrides (None = not given): ``endpoint`` (generic semantics: /v1/<signal> appended for
        HTTP), ``signal_endpoint`` (used as is), ``protocol``, ``headers`` (dict or the env string
        format), ``timeout_s`` (seconds), ``compression`` ("gzip"/"none"), ``insecure``,
        ``certificate``, ``client_key``, ``client_certificate``, ``max_request_bytes``,
        ``retry_initial_s``, ``retry_max_s``, ``backpressure_s``. plasmient's own variables:
        ``PLASMIENT_OTLP_MAX_REQUEST_MIB`` (largest request body, MiB) and
        ``PLASMIENT_OTLP_BACKPRESSURE_S`` (wait on a busy backend per request, seconds).
        """
        env = os.environ if env is None else env
        known = {
            "endpoint", "signal_endpoint", "protocol", "headers", "timeout_s", "compression", "insecure",
            "certificate", "client_key", "client_certificate", "max_request_bytes", "retry_initial_s", "retry_max_s",
            "backpressure_s",
        }  # fmt: skip
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown OtlpConfig override(s): {', '.join(sorted(unknown))}")
        given = {k: v for k, v in overrides.items() if v is not None}
        sig = signal.upper()

        def var(name: str) -> tuple[str, str] | None:
            """(variable name, value) of the signal-specific variable, else the generic one."""
            for full in (f"OTEL_EXPORTER_OTLP_{sig}_{name}", f"OTEL_EXPORTER_OTLP_{name}"):
                value = env.get(full)
                if value is not None and value.strip() != "":
                    return full, value.strip()
            return None

        protocol = given.get("protocol") or (var("PROTOCOL") or (None, DEFAULT_PROTOCOL))[1]
        protocol = protocol.strip().lower()
        if protocol not in PROTOCOLS:
            source = "protocol argument" if "protocol" in given else (var("PROTOCOL") or ("",))[0]
            raise ValueError(f"{source}={protocol!r}: OTLP protocol must be one of {', '.join(PROTOCOLS)}")
        is_http = protocol.startswith("http")

        generic = given.get("endpoint") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or None
        value = None
        try:
            if "signal_endpoint" in given:
                value = given["signal_endpoint"]
                endpoint = _as_is_url(value) if is_http else value
            elif "endpoint" not in given and env.get(f"OTEL_EXPORTER_OTLP_{sig}_ENDPOINT", "").strip():
                value = env[f"OTEL_EXPORTER_OTLP_{sig}_ENDPOINT"].strip()
                endpoint = _as_is_url(value) if is_http else value
            else:
                value = generic
                endpoint = _signal_endpoint(generic, protocol, signal)
        except ValueError as exc:  # the URL parser's own words ("Invalid IPv6 URL") name no endpoint
            said = str(exc) if redact_url(str(value)) == str(value) else "its user:password part cannot be parsed"
            raise ValueError(_without_userinfo(f"OTLP endpoint {redact_url(str(value))!r} ({protocol}) is not usable: "
                                               f"{said}", str(value))) from None
        explicit = "signal_endpoint" in given or generic is not None or bool(env.get(f"OTEL_EXPORTER_OTLP_{sig}_ENDPOINT", "").strip())

        if "headers" in given:
            h = given["headers"]
            headers_text = h if isinstance(h, str) else ""
            headers = parse_headers(h) if isinstance(h, str) else {str(k).lower(): str(v) for k, v in dict(h).items()}
        else:
            hv = var("HEADERS")
            headers_text = hv[1] if hv else ""
            headers = parse_headers(headers_text)
        ignored_headers = malformed_header_entries(headers_text)

        if "timeout_s" in given:
            timeout_s = float(given["timeout_s"])
        elif tv := var("TIMEOUT"):
            try:
                timeout_s = float(tv[1]) / 1000.0  # the spec's unit is milliseconds
            except ValueError:
                raise ValueError(f"{tv[0]}={tv[1]!r}: expected a timeout in milliseconds") from None
            if not timeout_s > 0:
                raise ValueError(f"{tv[0]}={tv[1]!r}: the timeout must be positive (milliseconds)")
        else:
            timeout_s = DEFAULT_TIMEOUT_S

        if "compression" in given:
            compression = str(given["compression"]).strip().lower()
        else:
            compression = (var("COMPRESSION") or (None, "none"))[1].lower()
        if compression not in ("gzip", "none", ""):
            raise ValueError(f"OTLP compression {compression!r} is not supported (gzip or none)")

        if "insecure" in given:
            insecure = bool(given["insecure"])
        elif iv := var("INSECURE"):
            insecure = _parse_bool(iv[0], iv[1])
        else:
            insecure = False

        def path_var(key: str, name: str) -> str | None:
            if key in given:
                return _pem_file(f"{key} argument", str(given[key]))
            v = var(name)
            return _pem_file(*v) if v else None

        kwargs: dict[str, Any] = {
            k: given[k] for k in ("max_request_bytes", "retry_initial_s", "retry_max_s", "backpressure_s") if k in given
        }
        if "max_request_bytes" not in kwargs and (mib := _env_number(env, "PLASMIENT_OTLP_MAX_REQUEST_MIB")) is not None:
            kwargs["max_request_bytes"] = int(mib * (1 << 20))
        if "backpressure_s" not in kwargs and (wait := _env_number(env, "PLASMIENT_OTLP_BACKPRESSURE_S")) is not None:
            kwargs["backpressure_s"] = wait
        return cls(
            endpoint=endpoint,
            protocol=protocol,
            headers=headers,
            timeout_s=timeout_s,
            compression="gzip" if compression == "gzip" else None,
            insecure=insecure,
            certificate=path_var("certificate", "CERTIFICATE"),
            client_key=path_var("client_key", "CLIENT_KEY"),
            client_certificate=path_var("client_certificate", "CLIENT_CERTIFICATE"),
            signal=signal,
            explicit=explicit,
            generic_endpoint=generic,
            ignored_headers=ignored_headers,
            **kwargs,
        )

    @property
    def request_headers(self) -> dict[str, str]:
        """What every request carries: the configured headers, and Basic auth from the endpoint's
        ``user:password@`` (:func:`url_credentials_headers`); what :func:`redact` keeps out of messages."""
        return {**self.headers, **url_credentials_headers(self.endpoint, self.headers)}

    def for_signal(self, signal: str, env: Mapping[str, str] | None = None) -> OtlpConfig:
        """The same settings for another signal (e.g. metrics): its own endpoint variable
        (OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, used as is) wins, else the generic endpoint + /v1/<signal>."""
        env = os.environ if env is None else env
        own = env.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", "").strip()
        is_http = self.protocol.startswith("http")
        if own:
            endpoint = _as_is_url(own) if is_http else own
        elif self.generic_endpoint is None and self.explicit and not is_http:
            endpoint = self.endpoint  # a gRPC target serves every signal
        else:
            endpoint = _signal_endpoint(self.generic_endpoint, self.protocol, signal)
        return replace(self, signal=signal, endpoint=endpoint)

    def with_(self, **changes: Any) -> OtlpConfig:
        """A copy with some fields changed (dataclasses.replace)."""
        return replace(self, **changes)


def redact_url(url: str) -> str:
    """The URL (or a text quoting URLs) with any ``user:password@`` replaced by ``***@``."""
    return _BARE_USERINFO.sub("***@", _USERINFO.sub(r"\1***@", str(url)))


def _without_userinfo(text: str, endpoint: str) -> str:
    """``text`` with the endpoint's own user:password (what precedes its last '@', after any scheme) replaced,
    whatever characters it holds: a quote in it ended the pattern redact_url matches, and the password was
    printed whole."""
    if "@" not in endpoint:
        return text
    secret = endpoint.split("://", 1)[-1].rsplit("@", 1)[0]
    for form in {secret, repr(secret)[1:-1]}:
        if len(form) >= 3:
            text = text.replace(form, "***")
    return text


def _usable_problem(endpoint: str, protocol: str) -> str | None:
    """:func:`_endpoint_problem` in words that quote nothing of the endpoint's credentials: the URL parser's
    message for a password holding a '/' quoted part of it ("Port could not be cast to integer value as 'pa'")."""
    problem = _endpoint_problem(endpoint, protocol)
    if problem is None or redact_url(endpoint) == endpoint:
        return problem
    return _endpoint_problem(redact_url(endpoint), protocol) or (
        "its user:password holds a character a URL must percent-encode there (/ ? # @)")


def url_credentials_headers(endpoint: str, headers: Mapping[str, str]) -> dict[str, str]:
    """``authorization: Basic ...`` from an endpoint's ``user:password@`` when the headers carry no
    authorization of their own: HTTP dropped the credentials without a word, and gRPC refused the target
    ("Misformatted domain name"). Empty when there are none."""
    parts = urllib.parse.urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
    if parts.username is None or any(k.lower() == "authorization" for k in headers):
        return {}
    pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
    return {"authorization": "Basic " + base64.b64encode(pair.encode()).decode()}


def redact(text: str, config: OtlpConfig | None = None) -> str:
    """``text`` with URL credentials and every configured header value (also as the escaped forms
    error messages quote: repr, percent-encoded, line by line) replaced by ``***``."""
    text = redact_url(text)
    if config is None:
        return text
    secrets: set[str] = set()
    userinfo = urllib.parse.urlsplit(config.endpoint if "://" in config.endpoint else f"//{config.endpoint}").netloc
    if "@" in userinfo:  # also where a library quotes the netloc without its scheme (gRPC's resolver)
        secrets.add(userinfo.rsplit("@", 1)[0])
    for value in config.request_headers.values():
        value = str(value)
        forms = {value, repr(value)[1:-1], repr(value.encode("utf-8", "replace"))[2:-1],
                 urllib.parse.quote(value, safe=""), urllib.parse.quote(value)}
        forms |= {part for part in value.splitlines()} | {part for part in value.split()}
        secrets |= {f for f in forms if len(f.strip()) >= 3}
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text
