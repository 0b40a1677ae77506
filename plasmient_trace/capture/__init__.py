"""Live capture of a running PyTorch job: one trace per step through the same pipeline as ingest.

    import plasmient_trace.capture as capture
    capture.start()                  # or PLASMIENT_TRACE=1 / opentelemetry-instrument / plasmient run
    with capture.step():             # explicit steps for inference loops (optimizer.step() is automatic)
        model(x)

One session per process; ``start`` is idempotent and ``stop`` runs at interpreter exit. A child made
by fork() is not traced (its parent's session goes on). This module
imports nothing heavy (no torch, numpy or pyarrow) so the startup hooks can import it for free.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import Any, Iterator

_session: Any = None
_lock = threading.Lock()


def _detach_after_fork() -> None:
    """In a child made by fork(): the session's worker thread did not come along, so the child's exit
    would wait the whole flush timeout on it and print a loss that is the parent's to report. The child
    is not traced; the parent's session goes on. No lock is taken: another thread may have held it."""
    global _lock, _session
    session, _session = _session, None
    _lock = threading.Lock()
    if session is not None:
        session.detach_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_detach_after_fork)


def start(config: Any = None, exporters: list | None = None, **overrides: Any) -> Any:
    """Start (or return) the process's CaptureSession; never raises into the caller."""
    global _session
    from .autostart import note_started  # standard library only, as this module

    note_started()
    with _lock:
        if _session is not None and not _session.closed:
            if config is not None or exporters is not None or overrides:
                # the settings asked for now are not the running session's: say so, not take them silently
                from .config import say_once

                say_once("start-again", "start() while already tracing (started earlier, e.g. by PLASMIENT_TRACE=1 "
                                        "or plasmient run): its settings stay and these are ignored; stop() first")
            return _session
        try:
            from .session import CaptureConfig, CaptureSession

            cfg = config or CaptureConfig.from_env(**overrides)
            _session = CaptureSession(cfg, exporters=exporters).start()
            if _session.failed:
                _session = None
            else:
                atexit.register(_stop_at_exit)
                _flush_on_ending_signals()
        except Exception as err:  # e.g. torch not importable
            try:
                print(f"plasmient-trace: tracing not started: {type(err).__name__}: {err}", file=sys.stderr)
            except Exception:
                pass
            _session = None
        return _session


def _flush_queued() -> None:
    """Write what the session has queued, bounded by PLASMIENT_FLUSH_TIMEOUT_S; never raises."""
    session = _session
    if session is not None and not session.closed:
        try:
            session.flush(session.config.flush_timeout_s)
        except Exception:
            pass


def _flush_on_ending_signals() -> None:
    from . import ending_signals

    ending_signals.install(flush=_flush_queued, stop=stop)


def stop(timeout: float | None = None) -> None:
    """Flush queued steps (bounded wait) and remove every hook."""
    global _session
    with _lock:
        session, _session = _session, None
    if session is not None:
        session.close(timeout)
    if "plasmient_trace.capture.ending_signals" in sys.modules:
        sys.modules["plasmient_trace.capture.ending_signals"].remove()


def _stop_at_exit() -> None:
    """:func:`stop` at interpreter exit, keeping CPython's note that Ctrl-C ended the program.

    After an unhandled KeyboardInterrupt CPython dies of SIGINT, so a shell sees 130. But an exec() of
    source text anywhere in the process meanwhile (a dataclass or namedtuple defined by a late import,
    in our background threads too) clears that note, and the job would exit with status 1. The note is
    set again when the program's uncaught exception, as CPython printed it, was a KeyboardInterrupt."""
    ended_by_ctrl_c = isinstance(getattr(sys, "last_exc", None) or getattr(sys, "last_value", None),
                                 KeyboardInterrupt)
    try:
        stop()
    finally:
        if ended_by_ctrl_c:
            try:
                import ctypes

                ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 1
            except (AttributeError, ValueError, OSError):
                # Python 3.12+ keeps the note inside _PyRuntime, out of reach: there the session's worker
                # importing what it needs at its start is what keeps exit free of such exec() calls.
                pass


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
