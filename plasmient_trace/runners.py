"""Engines for the rank tasks of :mod:`plasmient_trace.ranks`: a local process pool (default) and Ray (``--ray``).

Both have one small interface, :class:`RankRunner`: ``parse(paths, options)`` yields ``(digest, handle)``
per rank and ``stitch(handles, jobs, options)`` yields a ``RankPart`` per rank, both in input order, so the
first bad file in that order raises its own one-line error, as a sequential read would; ``close()``
frees what the runner made (processes, temporary files, a Ray it started).

Where a rank's records wait between the two maps (``handle``):

* process pool: a task cannot be sent to the worker that parsed the rank, so map 1 pickles the records
  to a file in a private temporary directory and map 2 loads (and deletes) it. Pickling a rank and loading it
  back costs 2-10% of parsing it (0.004-0.02 s against 0.07-0.88 s on the shared traces: Arrow tables
  pickle as buffers; ``benchmarks/bench_ranks.py --spill-cost``). Re-reading would parse every file
  twice, and a per-worker cache would hit only 1 time in ``workers``.
  A worker holds one rank at a time; the parent holds no record table.
* Ray: map 1 returns the records as a second object, which stays in the object store of the node that
  parsed them; map 2 is given its reference, so they never pass through the driver, and Ray prefers to
  run map 2 where the object already is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import signal
import socket
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .arrow_memory import use_offline_pool
from .held_signals import HeldSignals
from .ranks import RankDigest, RankPart, StitchJob, parse_rank, stitch_part
from .sources.kineto import TraceFormatError
from .sources.parallel import default_workers, worker_context

if TYPE_CHECKING:
    from .pipeline import IngestOptions

RAY_MISSING = "--ray needs Ray: pip install 'plasmient-trace[ray]'"


class RankRunner(Protocol):
    def parse(self, paths: list[Path], options: IngestOptions) -> Iterator[tuple[RankDigest, Any]]: ...

    def stitch(self, handles: list[Any], jobs: list[StitchJob], options: IngestOptions) -> Iterator[RankPart]: ...

    def close(self, abort: bool = False) -> None: ...


def open_runner(options: IngestOptions, n_ranks: int) -> RankRunner:
    if options.ray is not None:
        return RayRunner(options.ray, options.workers if options.workers > 1 else default_workers(os.cpu_count() or 1))
    return PoolRunner(options.workers, n_ranks)


# -- local process pool ---------------------------------------------------------------------------------

def _spill_failed(path: str, spill: str, err: OSError) -> TraceFormatError:
    return TraceFormatError(f"{path}: cannot keep its parsed records in {Path(spill).parent} between the pool's two "
                            f"steps ({err.strerror or err}): free space there, point TMPDIR elsewhere, or use --workers 1")


def _parse_and_spill(path: str, index: int, options: IngestOptions, spill: str) -> tuple[RankDigest, str]:
    records, digest = parse_rank(path, index, options)
    try:
        with open(spill, "wb") as f:
            pickle.dump(records, f, protocol=pickle.HIGHEST_PROTOCOL)
    except OSError as err:  # a full or read-only $TMPDIR: one line, not a worker's traceback
        with contextlib.suppress(OSError):
            os.unlink(spill)
        raise _spill_failed(path, spill, err) from None
    return digest, spill


def _load_and_stitch(spill: str, job: StitchJob, options: IngestOptions, path: str = "") -> RankPart:
    try:
        with open(spill, "rb") as f:
            records = pickle.load(f)
        os.unlink(spill)
    except OSError as err:  # removed from under the pool (a $TMPDIR cleaner)
        raise _spill_failed(path or spill, spill, err) from None
    return stitch_part(records, job, options)


class PoolRunner:
    """A ``forkserver`` process pool (a parent that already runs threads cannot hand a child a held lock), or
    ``spawn`` where the forkserver's socket does not fit under $TMPDIR (``sources.parallel.worker_context``)."""

    def __init__(self, workers: int, n_ranks: int, start_method: str = "forkserver") -> None:
        context = worker_context(start_method)
        if context.get_start_method() == "forkserver":
            # Workers fork from a server that has imported the tasks (numpy, pyarrow, the stitcher) once,
            # rather than each importing them again. Takes effect when this process starts its server.
            context.set_forkserver_preload(["plasmient_trace.runners", "plasmient_trace.pipeline"])
        self.pool = ProcessPoolExecutor(max_workers=max(1, min(workers, n_ranks)), mp_context=context,
                                        initializer=use_offline_pool)
        self.spill = Path(tempfile.mkdtemp(prefix="plasmient-ranks-"))
        self.paths: list[Path] = []

    def parse(self, paths: list[Path], options: IngestOptions) -> Iterator[tuple[RankDigest, Any]]:
        self.paths = list(paths)
        # submit forks the workers: a SIGTERM/Ctrl-C raised inside a fork left a worker the pool never
        # learnt of, which outlived the ingest waiting for work, holding its stderr (or died printing
        # a traceback under "plasmient: terminated")
        with HeldSignals():
            futures = [self.pool.submit(_parse_and_spill, str(p), i, options, str(self.spill / f"{i}.pickle"))
                       for i, p in enumerate(self.paths)]
        return self._in_order(futures)

    def stitch(self, handles: list[Any], jobs: list[StitchJob], options: IngestOptions) -> Iterator[RankPart]:
        with HeldSignals():
            futures = [self.pool.submit(_load_and_stitch, h, job, options, str(p))
                       for h, job, p in zip(handles, jobs, self.paths)]
        return self._in_order(futures)

    def _in_order(self, futures: list[Future]) -> Iterator[Any]:
        try:
            for path, future in zip(self.paths, futures):
                try:
                    yield future.result()
                except BrokenProcessPool:
                    # Killed (often by the OOM killer), or unable to start: forkserver re-imports
                    # __main__ from its file, which a script fed on stdin does not have.
                    raise TraceFormatError(f"{path}: the worker process handling it died (killed, out of memory, "
                                           "or could not start); retry with --workers 1") from None
        finally:
            for future in futures:
                future.cancel()

    def close(self, abort: bool = False) -> None:
        """Stop the pool and remove the spill directory, whole: signals wait. ``abort`` (an error, Ctrl-C,
        SIGTERM): the workers are stopped where they are, not waited for (a large rank's parse or stitch
        kept a SIGTERM'd ingest running 5-8 s more)."""
        with HeldSignals():
            if abort:
                # ProcessPoolExecutor has no public way to stop its workers before Python 3.14
                # (terminate_workers); its shutdown then finds them gone and returns
                for process in list((getattr(self.pool, "_processes", None) or {}).values()):
                    with contextlib.suppress(Exception):
                        process.terminate()
            self.pool.shutdown(wait=True, cancel_futures=True)
            shutil.rmtree(self.spill, ignore_errors=True)


# -- Ray ------------------------------------------------------------------------------------------------

def _ray_parse(path: str, index: int, options: IngestOptions) -> tuple[RankDigest, Any]:
    records, digest = parse_rank(path, index, options)
    return digest, records


# How long the head of a Ray cluster named by --ray has to accept a connection and greet it.
RAY_CONNECT_TIMEOUT_S = 10.0
# An HTTP/2 client's first bytes (the connection preface and an empty SETTINGS frame): Ray's GCS and its
# client server speak gRPC, so they answer with a SETTINGS frame of their own.
_HTTP2_HELLO = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_WHAT_RAY_TAKES = ("--ray takes the head's GCS address, host:port (6379 unless `ray start --port` named another), "
                   "or ray://host:10001; not the dashboard's URL (8265)")


def _unreachable(address: str, timeout: float = RAY_CONNECT_TIMEOUT_S) -> str | None:
    """Why no Ray head answers at ``address`` (None: one does, or the address is one Ray resolves itself,
    "auto" or "local"). ray.init would retry for some 12 minutes (20 tries of a ~36 s connect), printing
    its own log lines, at an address where nothing listens or something else (an HTTP server) does."""
    if address in ("auto", "local"):
        return None
    client = address.startswith("ray://")
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if "://" in target or not host or not port.isdigit():
        return f"not a Ray address: {_WHAT_RAY_TAKES}"
    try:
        from ray._private.services import canonicalize_bootstrap_address

        # as ray.init does: a loopback host becomes this node's address
        target = target if client else (canonicalize_bootstrap_address(target) or target)
        host, _, port = target.rpartition(":")
    except Exception:
        pass  # a private helper that moved: the address as given
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as conn:
            conn.settimeout(timeout)
            conn.sendall(_HTTP2_HELLO)
            greeting = conn.recv(9)
    except TimeoutError:
        return f"no answer from {target} within {timeout:g}s"
    except OSError as err:
        return f"nothing answers at {target} ({err.strerror or type(err).__name__})"
    if len(greeting) == 9 and greeting[3] == 4:  # a SETTINGS frame
        return None
    return f"{target} answers, but not as a Ray head does (gRPC): {_WHAT_RAY_TAKES}"


def _caller_sigterm_handler() -> Any:
    """The SIGTERM handler a caller set in the main thread (a Python callable), else None."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    handler = signal.getsignal(signal.SIGTERM)
    return handler if callable(handler) else None


class RayRunner:
    """The same tasks as Ray remote functions, on the cluster at ``address`` ("" = a local Ray started
    here with ``cpus`` CPUs). A Ray this runner started is stopped on exit; one already running is left."""

    def __init__(self, address: str, cpus: int) -> None:
        try:
            import ray
        except ImportError:
            raise TraceFormatError(RAY_MISSING) from None
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            unreachable = _unreachable(address) if address else None
            if unreachable:
                raise TraceFormatError(f"--ray {address}: {unreachable}")
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "logging_level": logging.ERROR}
            sigterm = _caller_sigterm_handler()
            try:
                try:
                    # No address: a new local Ray of `cpus` CPUs, unless ray.init finds one (RAY_ADDRESS, or a
                    # `ray start` on this machine), which refuses to be sized: then join it as it is.
                    ray.init(address=address or None, **kwargs, **({} if address else {"num_cpus": max(1, cpus)}))
                except (RuntimeError, ValueError):
                    if address:
                        raise
                    ray.init(**kwargs)
            except (ConnectionError, RuntimeError, ValueError, TimeoutError) as err:
                what = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
                raise TraceFormatError(f"--ray {address or '(local)'}: cannot start or reach Ray: {what}") from None
            finally:
                if sigterm is not None:
                    # ray.init replaces it with a handler that dumps a native stack and exits 15: the caller's
                    # (the CLI's: stop through the cleanup, exit 143) stays in charge
                    signal.signal(signal.SIGTERM, sigterm)
            self.started = True
        self._parse = ray.remote(num_returns=2)(_ray_parse)
        self._stitch = ray.remote(stitch_part)
        self.paths: list[Path] = []

    def parse(self, paths: list[Path], options: IngestOptions) -> Iterator[tuple[RankDigest, Any]]:
        self.paths = list(paths)
        refs = [self._parse.remote(str(p), i, options) for i, p in enumerate(self.paths)]
        return self._in_order([d for d, _ in refs], [r for _, r in refs])

    def stitch(self, handles: list[Any], jobs: list[StitchJob], options: IngestOptions) -> Iterator[RankPart]:
        refs = [self._stitch.remote(h, job, options) for h, job in zip(handles, jobs)]
        handles.clear()  # the records are freed as soon as their stitch no longer needs them
        return (part for part, _ in self._in_order(refs, None))

    def _in_order(self, refs: list[Any], handles: list[Any] | None) -> Iterator[tuple[Any, Any]]:
        exceptions = self.ray.exceptions
        done, finished = 0, False
        try:
            for i, (path, ref) in enumerate(zip(self.paths, refs)):
                try:
                    value = self.ray.get(ref)
                except exceptions.RayTaskError as err:
                    cause = getattr(err, "cause", None)
                    if isinstance(cause, Exception):
                        raise cause from None
                    raise TraceFormatError(f"{path}: {str(err).splitlines()[0]}") from None
                except exceptions.RayError as err:
                    raise TraceFormatError(f"{path}: the Ray task handling it failed "
                                           f"({type(err).__name__}); retry without --ray") from None
                done = i + 1
                yield value, (handles[i] if handles is not None else None)
            finished = True
        except BaseException as exc:
            # Ctrl-C, SIGTERM, or the consumer gone, on a Ray this runner started: its shutdown stops every
            # task. Cancelling them first raced Ray's own completion of one ("Tried to complete task that was
            # not pending", a native check failure: exit 1 with a stack dump, 1 run in 3 here).
            if not isinstance(exc, Exception) and self.started:
                finished = True
            raise
        finally:
            if not finished:
                self._drain(refs[done:] + (handles[done:] if handles is not None else []))

    def _drain(self, refs: list[Any]) -> None:
        """Stop the tasks left behind an error and collect what they return: Ray logs a multi-line
        "Unhandled error" for every failed or cancelled result dropped unread (the failed parse's records too)."""
        for ref in refs:
            with contextlib.suppress(Exception):  # finished already, or the cluster is gone
                self.ray.cancel(ref)
        with contextlib.suppress(Exception):
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=30)
            for ref in ready:
                with contextlib.suppress(Exception):
                    self.ray.get(ref, timeout=0)

    def close(self, abort: bool = False) -> None:
        if self.started:  # its shutdown stops every task, finished or not
            self.ray.shutdown()
