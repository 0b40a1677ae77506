"""Shared pieces of the live-capture tests: an in-memory exporter and the tiny example model."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

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


@contextlib.contextmanager
def live_capture(close_timeout: float = 30, **config: Any) -> Iterator[tuple[Any, Collect]]:
    """A started live CaptureSession exporting into memory (``environ`` {} unless given), closed on exit:
    yields (session, sink); assert on ``sink.rows()`` and ``session.stats`` after the ``with`` block."""
    from plasmient_trace.capture.session import CaptureConfig, CaptureSession

    sink = Collect()
    session = CaptureSession(CaptureConfig(**{"environ": {}, **config}), exporters=[("memory", sink)]).start()
    try:
        yield session, sink
    finally:
        session.close(timeout=close_timeout)


def sampled_live_session(out: Path, every: int, steps: int = 12, during: Callable[[Any, int], None] | None = None,
                         **config: Any) -> Any:
    """A real live capture of a small model into ``out``, full depth every `every`-th step, the rest at step depth;
    ``during(session, step)`` runs after each step, ``config`` overrides CaptureConfig's fields. Returns the
    closed session."""
    import pytest

    torch = pytest.importorskip("torch")
    from plasmient_trace.capture.session import CaptureConfig, CaptureSession

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(32, 64)
    fields = {"out": str(out), "every": every, "peak_tflops": 1.0, "gpu_price": 3.6, "job_id": f"sampled-{every}",
              "environ": {}, **config}
    session = CaptureSession(CaptureConfig(**fields)).start()
    try:
        for i in range(steps):
            with session.step():
                model.zero_grad(set_to_none=True)
                model(x).pow(2).mean().backward()
            if during is not None:
                during(session, i)
    finally:
        session.close(timeout=60)
    return session


def sampled_live_run(out: Path, every: int, steps: int = 12) -> Path:
    """A real live capture of a small model, full depth every `every`-th step, the rest at step depth."""
    session = sampled_live_session(out, every, steps)
    assert not session.failed and session.stats["steps_dropped"] == 0
    return out


def flop_counter_per_step(make: Callable[[], Any], step: Callable[[Any, int], None], n: int) -> list[float]:
    """The oracle of carried FLOPs: torch's FlopCounterMode total of each of n steps, run untraced on a fresh
    ``make()``."""
    from torch.utils.flop_counter import FlopCounterMode

    state = make()
    out = []
    for i in range(n):
        with FlopCounterMode(display=False) as counter:
            step(state, i)
        out.append(float(counter.get_total_flops()))
    return out
