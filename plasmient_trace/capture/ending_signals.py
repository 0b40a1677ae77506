"""Flush the queued steps when the job is told to end (SIGTERM, SIGHUP), without the job seeing a difference.

The default action of these signals ends the process without atexit, so without a flush. Where the job left
one at its default, our handler takes it: it flushes (bounded by PLASMIENT_FLUSH_TIMEOUT_S), then dies of the
signal as the job would have, so the exit status is unchanged. SIGINT needs nothing: KeyboardInterrupt runs
atexit.

The job must not see that handler. A job that chains the handler it replaced (``prev = getsignal(SIGTERM)``;
``prev(...) if callable(prev) else sys.exit(143)``) found ours, callable, called it, and trained on where the
plain job exits; Lightning's connector does the same test and trains on in both. So, while ours is installed,
``signal.getsignal`` answers what the job would see without us (the default, or the job's own handler), and
``signal.signal`` puts the job's handler in place behind a wrapper that flushes first and then calls it, so
the steps before a preemption notice are written even when the job then ends with ``os._exit``. :func:`remove`
restores the job's handlers and the two functions (``__wrapped__`` on the wrapper names the job's own).
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable
from typing import Any

from .step_hooks import drop_own_frame

# a scheduler's SIGTERM, and the SIGHUP a job started from a terminal gets when its ssh session drops
NAMES = ("SIGTERM", "SIGHUP")

_real_signal = signal.signal
_real_getsignal = signal.getsignal
_visible: dict[int, Any] = {}  # signal -> the handler the job believes is installed, while ours serves it
_flush: Callable[[], None] = lambda: None  # noqa: E731 - set by install
_stop: Callable[[], None] = lambda: None  # noqa: E731


def ending_signals() -> list[int]:
    return [getattr(signal, name) for name in NAMES if hasattr(signal, name)]


def install(flush: Callable[[], None], stop: Callable[[], None]) -> None:
    """Take the ending signals the job left at their default (main thread only). ``flush`` writes what is
    queued (bounded); ``stop`` ends the session (bounded). Neither may raise."""
    global _flush, _stop
    if threading.current_thread() is not threading.main_thread():
        return
    _flush, _stop = flush, stop
    for sig in ending_signals():
        try:
            if _real_getsignal(sig) is signal.SIG_DFL:
                _real_signal(sig, _on_ending_signal)
                _visible[sig] = signal.SIG_DFL
        except (ValueError, OSError):
            pass
    if _visible:
        signal.signal, signal.getsignal = _job_signal, _job_getsignal


def remove() -> None:
    """Give every ending signal back the handler the job set (or its default) and restore the functions."""
    for sig, handler in list(_visible.items()):
        try:
            if _is_ours(_real_getsignal(sig)):
                _real_signal(sig, handler)
        except (ValueError, OSError):
            pass
    _visible.clear()
    if signal.signal is _job_signal:
        signal.signal = _real_signal
    if signal.getsignal is _job_getsignal:
        signal.getsignal = _real_getsignal


def _is_ours(handler: Any) -> bool:
    return handler is _on_ending_signal or getattr(handler, "_plasmient_flushes_first", False)


def _served(signum: int) -> bool:
    """Whether ours still serves the signal: code holding the original ``signal.signal`` may have replaced it."""
    if signum not in _visible:
        return False
    if _is_ours(_real_getsignal(signum)):
        return True
    del _visible[signum]
    return False


def _job_getsignal(signalnum: int) -> Any:
    return _visible[signalnum] if _served(signalnum) else _real_getsignal(signalnum)


def _job_signal(signalnum: int, handler: Any) -> Any:
    if not _served(signalnum):
        return _real_signal(signalnum, handler)
    previous = _visible[signalnum]
    if callable(handler):
        _real_signal(signalnum, _flushing_first(handler))
    elif handler == signal.SIG_DFL:
        _real_signal(signalnum, _on_ending_signal)
    else:  # SIG_IGN (or what the real function refuses): the job ignores it, nothing ends
        _real_signal(signalnum, handler)
        _visible.pop(signalnum)
        return previous
    _visible[signalnum] = handler
    return previous


def _flushing_first(handler: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(handler)
    def flush_then_handle(signum: int, frame: Any) -> Any:
        _flush()
        try:
            return handler(signum, frame)
        except BaseException as err:  # the job's handler raised (signal.default_int_handler's KeyboardInterrupt)
            drop_own_frame(err)  # its traceback is the one it prints untraced
            raise

    flush_then_handle._plasmient_flushes_first = True  # type: ignore[attr-defined]
    return flush_then_handle


def _on_ending_signal(signum: int, _frame: Any) -> None:
    import os

    if _real_getsignal(signum) is not _on_ending_signal:
        # Called by a handler that took ours from the real signal.getsignal before we hid it: whether the job
        # ends is the job's to decide; what is queued is written now in case it ends without atexit.
        _flush()
        return
    # A second signal is common (a scheduler signals every process of the job): ignored while the bounded
    # flush runs, then the default action ends the process.
    ours = [sig for sig in ending_signals() if _real_getsignal(sig) is _on_ending_signal]
    for sig in ours:
        _real_signal(sig, signal.SIG_IGN)
    try:
        _stop()
    finally:
        remove()
        for sig in ours:
            _real_signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
