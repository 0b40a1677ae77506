"""Live capture of a running PyTorch job: one trace per step through the same pipeline as ingest.

    import plasmient_trace.capture as capture
    capture.start()                  # or PLASMIENT_TRACE=1 / opentelemetry-instrument / plasmient run
    with capture.step():             # explicit steps for inference loops (optimizer.step() is automatic)
        model(x)

One session per process; ``start`` is idempotent and ``stop`` runs at interpreter exit. This module
imports nothing heavy (no torch, numpy or pyarrow) so the startup hooks can import it for free.
"""

from __future__ import annotations

import atexit
import contextlib
import sys
import threading
from typing import Any, Iterator

_session: Any = None
_lock = threading.Lock()


def start(config: Any = None, exporters: list | None = None, **overrides: Any) -> Any:
    """Start (or return) the process's CaptureSession; never raises into the caller."""
    global _session
    with _lock:
        if _session is not None and not _session.closed:
            return _session
        try:
            from .session import CaptureConfig, CaptureSession

            cfg = config or CaptureConfig.from_env(**overrides)
            _session = CaptureSession(cfg, exporters=exporters).start()
            if _session.failed:
                _session = None
            else:
                atexit.register(stop)
        except Exception as err:  # e.g. torch not importable
            try:
                print(f"plasmient-trace: tracing not started: {type(err).__name__}: {err}", file=sys.stderr)
            except Exception:
                pass
            _session = None
        return _session


def stop(timeout: float | None = None) -> None:
    """Flush queued steps (bounded wait) and remove every hook."""
    global _session
    with _lock:
        session, _session = _session, None
    if session is not None:
        session.close(timeout)


def current() -> Any:
    """The running CaptureSession, or None. (Not named ``session``: that is the submodule.)"""
    return _session


@contextlib.contextmanager
def step() -> Iterator[None]:
    """An explicit step; a no-op when no capture is running, so it can stay in the code."""
    s = _session
    if s is None or s.closed:
        yield
        return
    with s.step():
        yield


def __getattr__(name: str) -> Any:
    if name in ("CaptureConfig", "CaptureSession"):
        from . import session as _s

        return getattr(_s, name)
    raise AttributeError(name)


__all__ = ["CaptureConfig", "CaptureSession", "current", "start", "step", "stop"]
