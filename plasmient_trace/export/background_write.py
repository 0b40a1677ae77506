"""Writing encoded bytes to a file on a thread of its own, a few MiB behind the encoder.

Copying the JSON lines into the page cache is a system call that releases the GIL: on a second core it
overlaps the encoding of the next part instead of following it (about a quarter of an ingest's export time
on the shared traces). The queue is bounded, so the bytes waiting are at most ``depth`` batches of about
``batch_bytes``; the pieces are memoryviews into the encoder's parts, which the queue keeps alive until they
are written. A write error is raised in the caller, at its next piece or at ``close``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

__all__ = ["BackgroundWriter"]


class BackgroundWriter:
    """``add`` pieces in order; ``close`` waits until every one is written (or ``abort`` drops the rest)."""

    def __init__(self, write: Callable[[bytes | memoryview], object], depth: int = 2, batch_bytes: int = 1 << 20) -> None:
        self._write = write
        self._queue: queue.Queue[list[bytes | memoryview] | None] = queue.Queue(depth)
        self._batch_bytes = batch_bytes
        self._pending: list[bytes | memoryview] = []
        self._pending_bytes = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="plasmient-jsonl-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            pieces = self._queue.get()
            if pieces is None:
                return
            if self._error is None:  # after a failure the rest is only drained, so the caller never blocks
                try:
                    for piece in pieces:
                        self._write(piece)
                except BaseException as err:  # noqa: BLE001 - handed to the caller, which raises it
                    self._error = err

    def add(self, piece: bytes | memoryview) -> None:
        self._pending.append(piece)
        self._pending_bytes += len(piece)
        if self._pending_bytes >= self._batch_bytes:
            if self._error is not None:
                raise self._error
            self._queue.put(self._pending)
            self._pending, self._pending_bytes = [], 0

    def close(self) -> None:
        """Write what is pending and wait for the thread; raises the first write error."""
        try:
            if self._pending and self._error is None:
                self._queue.put(self._pending)
        finally:
            self._pending = []
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        """Stop after what is queued (the caller is failing already): no error of ours replaces its own."""
        self._pending = []
        self._queue.put(None)
        self._thread.join()
