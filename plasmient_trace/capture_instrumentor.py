"""OpenTelemetry instrumentor: ``opentelemetry-instrument python train.py`` traces a PyTorch job.

The launcher loads every ``opentelemetry_instrumentor`` entry point and calls ``instrument()`` before
the program runs; ours arms plasmient-trace's live capture (it starts when the program imports
torch) with the same OTEL_* / PLASMIENT_* configuration as PLASMIENT_TRACE=1.
"""

from __future__ import annotations

from typing import Any, Collection

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor


class PlasmientInstrumentor(BaseInstrumentor):
    def instrumentation_dependencies(self) -> Collection[str]:
        return ("torch >= 2.0",)

    def _instrument(self, **kwargs: Any) -> None:
        from .capture import autostart

        autostart.install()

    def _uninstrument(self, **kwargs: Any) -> None:
        from .capture import autostart

        autostart.uninstall()
