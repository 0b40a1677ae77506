"""Shared pieces of the live-capture tests: an in-memory exporter and the tiny example model."""

from __future__ import annotations

import sys
from pathlib import Path

from plasmient_trace.conventions import SpanBatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_tiny_transformer as tiny  # noqa: E402,F401


class Collect:
    """Exporter that keeps every batch it is given."""

    def __init__(self) -> None:
        self.batches: list[SpanBatch] = []

    def __call__(self, batch: SpanBatch) -> None:
        self.batches.append(batch)

    def rows(self) -> list[dict]:
        return [r for b in self.batches for r in b.table.to_pylist()]
