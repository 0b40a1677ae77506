"""Which exporter carries each signal: ``OTEL_TRACES_EXPORTER`` and ``OTEL_METRICS_EXPORTER``, read as
the OpenTelemetry SDK environment specification describes them, for ingest and live capture alike.

Values are comma-separated lists of ``otlp``, ``console`` and ``none`` (``none`` alone turns the
signal off). Unset traces: OTLP when an OTLP endpoint is configured, else nothing (the caller then
writes its embedded default, a JSON lines file). Unset metrics: the step metrics follow the traces
over OTLP, so one endpoint receives both; ``OTEL_METRICS_EXPORTER=none`` turns them off, which is
what a traces-only backend (Jaeger, Phoenix) needs. Values plasmient does not implement (zipkin,
prometheus, ...) are ignored with a note, not an error: the same variables configure the other
OpenTelemetry SDKs in a live job's process, which may implement them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["EXPORTERS", "ExporterChoice", "select_exporters"]

EXPORTERS = ("otlp", "console", "none")


@dataclass(frozen=True)
class ExporterChoice:
    """The exporters of each signal (subsets of {"otlp", "console"}) and notes about ignored values."""

    traces: frozenset[str]
    metrics: frozenset[str]
    traces_off: bool  # OTEL_TRACES_EXPORTER=none: no embedded-default file either
    notes: tuple[str, ...] = field(default=())


def _kinds(env: Mapping[str, str], name: str, notes: list[str]) -> tuple[set[str], bool, bool]:
    """(exporters named, set at all, 'none' named) of one variable."""
    raw = env.get(name, "")
    kinds = {k.strip().lower() for k in raw.split(",") if k.strip()}
    unknown = sorted(kinds - set(EXPORTERS))
    if unknown:
        notes.append(f"{name}={raw.strip()!r}: plasmient exports {name.split('_')[1].lower()} with "
                     f"{', '.join(EXPORTERS)}; ignoring {', '.join(unknown)}")
    kinds &= set(EXPORTERS)
    return kinds - {"none"}, bool(kinds), "none" in kinds


def select_exporters(env: Mapping[str, str], otlp_endpoint_configured: bool) -> ExporterChoice:
    """The exporters ``env`` asks for; ``otlp_endpoint_configured``: an OTLP endpoint was given
    (argument or OTEL_EXPORTER_OTLP_*ENDPOINT), which turns OTLP on when OTEL_TRACES_EXPORTER is unset."""
    notes: list[str] = []
    traces, traces_set, traces_none = _kinds(env, "OTEL_TRACES_EXPORTER", notes)
    metrics, metrics_set, metrics_none = _kinds(env, "OTEL_METRICS_EXPORTER", notes)
    if traces_none:
        traces = set()
    elif not traces_set and otlp_endpoint_configured:
        traces = {"otlp"}
    if metrics_none:
        metrics = set()
    elif not metrics_set:
        metrics = {"otlp"} & traces
    return ExporterChoice(frozenset(traces), frozenset(metrics), traces_none, tuple(notes))
