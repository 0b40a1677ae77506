"""Read many trace files (one per rank) in a local process pool, returning every RecordSet to the caller.

The multi-rank ingest (``plasmient ingest --workers N``) does more than this in its workers: it parses
*and* stitches each rank there and keeps the records out of the parent (:mod:`plasmient_trace.ranks`).
``read_many`` remains for callers that want the record tables themselves.

Parsing is pure CPU work that holds the GIL, so ranks read in threads would run one at a time; each
worker process reads one file at a time and returns its RecordSet (Arrow tables pickle as buffers, not
per-row objects). Workers start with ``forkserver`` so a parent that already runs threads (a progress
bar, an exporter) cannot hand a child a held lock. Results come back in input order, and the first bad
file in that order raises its own one-line :class:`TraceFormatError`, exactly as a sequential read would.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from ..records import RecordSet
from .kineto import TraceFormatError, read_kineto


# The forkserver listens on a Unix socket at $TMPDIR/pymp-XXXXXXXX/listener-XXXXXXXX, and a socket's path holds
# at most 107 bytes: under a longer $TMPDIR (a batch scheduler's per-job directory) starting the pool raised
# "AF_UNIX path too long". Python 3.13 falls back to /tmp itself; here spawned workers, which need no socket.
_SOCKET_PATH_MAX = 107
_LISTENER_PATH = len("/pymp-XXXXXXXX/listener-XXXXXXXX")


def worker_context(start_method: str = "forkserver") -> multiprocessing.context.BaseContext:
    """The multiprocessing context for a worker pool: ``start_method``, but ``spawn`` where the forkserver's
    socket would not fit under this process's temporary directory."""
    if start_method == "forkserver" and len(os.fsencode(tempfile.gettempdir())) + _LISTENER_PATH > _SOCKET_PATH_MAX:
        start_method = "spawn"
    return multiprocessing.get_context(start_method)


def default_workers(n_files: int) -> int:
    """One worker per file, at most one per CPU this process may run on."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(n_files, cpus))


def read_many(
    paths: Sequence[str | Path],
    workers: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    start_method: str = "forkserver",
) -> list[RecordSet]:
    """read_kineto over every path, in ``workers`` processes (default: one per CPU); 1 = in this process."""
    paths = [Path(p) for p in paths]
    workers = default_workers(len(paths)) if workers is None else max(1, workers)
    if workers == 1 or len(paths) <= 1:
        out = []
        for i, path in enumerate(paths):
            if progress:
                progress(f"reading {path.name}", i, len(paths))
            out.append(read_kineto(path))
        return out
    context = worker_context(start_method)
    # imported here, not with the module: the live capture imports this module (through the pipeline) and may
    # do so while Python exits, when concurrent.futures.process can no longer register its exit hook
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    with ProcessPoolExecutor(max_workers=min(workers, len(paths)), mp_context=context) as pool:
        futures = [pool.submit(read_kineto, path) for path in paths]
        out = []
        try:
            for i, (path, future) in enumerate(zip(paths, futures)):
                if progress:
                    progress(f"reading {path.name}", i, len(paths))
                try:
                    out.append(future.result())
                except BrokenProcessPool:
                    # Killed (often by the OOM killer), or unable to start: forkserver re-imports
                    # __main__ from its file, which a script fed on stdin does not have.
                    raise TraceFormatError(f"{path}: the worker process reading it died (killed, out of memory, "
                                           "or could not start); retry with workers=1") from None
        except TraceFormatError:
            for future in futures:
                future.cancel()
            raise
        return out
