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


def warm_cpu_calibration(env: dict[str, str], threads: set[int] | None = None) -> None:
    """Fill env's PLASMIENT_CACHE_DIR with the CPU peaks a job will look up, as a user's earlier run (or an
    image build) would: live capture measures them in a detached child process that a short job can outlive."""
    import subprocess
    import sys

    import torch

    for n in sorted(threads or {1, torch.get_num_threads()}):
        subprocess.run([sys.executable, "-m", "plasmient_trace.metrics.cpu_peak", "--threads", str(n),
                        "--cache-dir", env["PLASMIENT_CACHE_DIR"]], env=env, check=True, capture_output=True, timeout=600)
