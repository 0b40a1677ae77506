"""Holding SIGINT/SIGTERM back from a stretch of work that must not be cut in the middle.

Python runs a signal's handler between two bytecodes of the main thread, wherever it is: inside a
process pool's ``submit`` while it forks a worker, or between a send and the write that records it.
An exception raised there leaves a half-made thing behind (a worker the pool does not know, which then
waits forever for work; a line sent but not marked sent). Inside :class:`HeldSignals` the two signals
are only noted; :meth:`HeldSignals.check` or leaving the block delivers the first one noted to the
handler that was there before, so it takes its usual effect once the work is whole.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

HELD = (signal.SIGINT, signal.SIGTERM)


class HeldSignals:
    """Only the main thread can install handlers; in any other thread this holds nothing back."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> HeldSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in HELD:
                self._saved[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signum

    def check(self) -> None:
        """Deliver a held signal now, between two whole pieces of work. Where its handler returns
        (one that ignores it), raise KeyboardInterrupt: the work was asked to stop."""
        if self.received is not None:
            self._deliver()
            raise KeyboardInterrupt

    def _deliver(self) -> None:
        received, self.received = self.received, None
        self._restore()
        if received is not None:
            signal.raise_signal(received)  # the restored handler, or the default action, runs here

    def _restore(self) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved = {}

    def __exit__(self, *_: Any) -> None:
        self._deliver()  # on an error too: being told to stop outranks it
