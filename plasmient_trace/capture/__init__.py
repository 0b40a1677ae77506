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


# Signals whose default action ends the process without running atexit, so without a flush: a scheduler's
# SIGTERM, and the SIGHUP a job started from a terminal gets when its ssh session drops.
_ENDING_SIGNALS = ("SIGTERM", "SIGHUP")


def _ending_signals() -> list[int]:
    import signal

    return [getattr(signal, name) for name in _ENDING_SIGNALS if hasattr(signal, name)]


def _flush_on_ending_signals() -> None:
    """Where the job left SIGTERM or SIGHUP at its default, flush (bounded by PLASMIENT_FLUSH_TIMEOUT_S)
    and then die of the signal as the job would have, so the exit status is unchanged. A handler the job
    sets later replaces ours: where it ends the job through SystemExit, atexit flushes. SIGINT needs
    nothing: KeyboardInterrupt runs atexit."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return
    for sig in _ending_signals():
        try:
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _on_ending_signal)
        except (ValueError, OSError):
            pass


def _on_ending_signal(signum: int, _frame: Any) -> None:
    import os
    import signal

    if signal.getsignal(signum) is not _on_ending_signal:
        # Called from a handler the job put in front of ours that calls the one it replaced (Lightning's
        # signal connector does, and may go on training: SLURM's preemption notice). Whether the job
        # ends is the job's to decide; what is queued is written now in case it ends without atexit.
        session = _session
        if session is not None and not session.closed:
            try:
                session.flush(session.config.flush_timeout_s)
            except Exception:
                pass
        return
    # A second signal is common (a scheduler signals the process group and `plasmient run` forwards
    # its own): ignored while the bounded flush runs, then the default action ends the process.
    ours = [sig for sig in _ending_signals() if signal.getsignal(sig) is _on_ending_signal]
    for sig in ours:
        signal.signal(sig, signal.SIG_IGN)
    try:
        stop()
    finally:
        for sig in ours:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def stop(timeout: float | None = None) -> None:
    """Flush queued steps (bounded wait) and remove every hook."""
    global _session
    with _lock:
        session, _session = _session, None
    if session is not None:
        session.close(timeout)
    try:
        import signal

        for sig in _ending_signals():
            if signal.getsignal(sig) is _on_ending_signal:
                signal.signal(sig, signal.SIG_DFL)
    except (ValueError, OSError):
        pass


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
