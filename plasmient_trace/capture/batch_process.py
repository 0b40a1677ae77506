"""The live capture's stitch and delivery in an interpreter of their own (``PLASMIENT_WORKER=process``).

On a thread of the job's process the stitch and the span encoding hold the GIL the training thread needs:
the same work cost the tiny transformer's loop 1.79x there and 1.01x from a process of its own
(``benchmarks/bench_gil_interference.py``). With this worker the session's batching thread only pickles
each batch's step captures (the native observer's packed op columns, module records, CUPTI's tables, and
the op signatures numbered since the last batch) to a child and waits, its GIL released, for a short reply.

The child is ``python -m plasmient_trace.capture.batch_process``, not multiprocessing's spawn (which runs
an unguarded training script's top level again), and never imports torch. It keeps what batches leave
each other (the carried FLOPs, the last stitched step), runs the same :func:`.batches.process`, and owns
the one delivery: the file, OTLP, the spill directory. Its stdout and stderr are the job's. It ignores
SIGINT and SIGTERM, which the job's own handling turns into a close; a job killed outright closes the
pipe, and the child delivers what it was given and ends.

One message each way per batch, length-prefixed pickles on a socket pair (sent with MSG_NOSIGNAL: a job that
restored SIGPIPE's default action is not killed by writing to a child that died):
``init`` (config, resource) -> ``ready``; ``batch`` (a :class:`Parcel`) -> ``done``; ``handover`` (the
job became multi-rank) -> the child's :class:`.batches.BatchMemory`; ``close`` (timeout) -> ``closed``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_HEADER = struct.Struct("<Q")
# Linux's flag; where there is none (macOS) a job that restored SIGPIPE's default action could die of a write to
# a dead child, as it could of any broken pipe of its own.
_NO_SIGPIPE = getattr(socket, "MSG_NOSIGNAL", 0)
# A ready child answers a batch within its stitch time (a fraction of a second for 8 full-depth steps of the tiny
# transformer); the first answer includes its imports (pyarrow, numpy: about a second, more on a loaded
# machine). One that answers within neither bound is wedged: it is killed and the thread takes over, so the
# batching thread never waits on it for good (a dead one closes the socket, which ends the wait at once).
_START_WAIT_S = 60.0
_REPLY_WAIT_S = 300.0
PREBUILT = "prebuilt"  # ops chunk already an Arrow table (the dispatch hook's records hold torch objects)


class WorkerGone(RuntimeError):
    """The batch process died, wedged or could not start: the session goes back to its own thread."""


@dataclass
class Parcel:
    """One batch as the child needs it."""

    items: list[Any]
    signatures: dict[int, tuple[int, list[list[str]]]]  # recorder key -> (its USER scope, signatures new since)
    cupti: dict[str, Any] | None
    context: dict[str, Any] = field(default_factory=dict)


# ---- the wire


def _send(sock: socket.socket, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data, _NO_SIGPIPE)


def _read_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        part = sock.recv_into(view[got:], min(n - got, 1 << 22))
        if not part:
            raise EOFError
        got += part
    return buf


def _receive(sock: socket.socket) -> Any:
    (n,) = _HEADER.unpack(_read_exactly(sock, _HEADER.size))
    return pickle.loads(_read_exactly(sock, n))


# ---- the job's side


class BatchProcess:
    """The child, seen from the session's batching thread."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self._sent_signatures: dict[int, int] = {}  # recorder key -> signatures the child has
        self.cpu_s = 0.0  # the child's CPU time, as it reports it

    def start(self, config: Any, resource: dict[str, Any], cwd: str | None = None) -> None:
        """Start the child in ``cwd`` and send it what it builds the delivery from (it answers at the first
        batch)."""
        import plasmient_trace

        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PLASMIENT_TRACE"] = "0"  # a startup hook in the child's interpreter must not trace it
        env.pop("PLASMIENT_RUN_DIR", None)  # nor leave `plasmient run` a mark of a process that traced
        root = os.path.dirname(os.path.dirname(os.path.abspath(plasmient_trace.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "plasmient_trace.capture.batch_process",
                                           str(theirs.fileno())],
                                          stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),), env=env, cwd=cwd)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._call_nowait(("init", {"config": config, "resource": dict(resource)}))

    def handle(self, session: Any, items: list[Any]) -> dict[str, Any]:
        """Send a batch, wait for its stitch and delivery; the child's reply (``want_full``, ``cpu_s``,
        ``local_errors``, ``error``). :class:`WorkerGone` when the child is not there to answer."""
        parcel = self._parcel(session, items)
        reply = self._call(("batch", parcel), kill_when_late=True)
        self.cpu_s += reply.get("cpu_s", 0.0)
        return reply

    def handover(self, timeout: float) -> Any:
        """The child delivers what it holds and ends; what its batches remembered (BatchMemory) comes back."""
        reply = self._call(("handover", timeout), wait_s=timeout + _START_WAIT_S)
        self._end(timeout)
        return reply["memory"]

    def close(self, timeout: float) -> None:
        """Deliver what the child holds within ``timeout`` s (the network's rest goes to the spill directory),
        then let it end. A child that does not answer in time is left to its own deadline, not killed."""
        try:
            self._call(("close", timeout), wait_s=timeout + 2.0)
        except WorkerGone:
            pass
        self._end(1.0)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _end(self, wait_s: float) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                self._proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass  # still delivering: it ends at its own deadline

    def _call_nowait(self, message: Any) -> None:
        if self._sock is None:
            raise WorkerGone("the batch process was ended")
        try:
            _send(self._sock, message)
        except OSError as err:
            raise self._gone(err) from None

    def _gone(self, err: BaseException) -> WorkerGone:
        code = None
        if self._proc is not None:
            try:
                code = self._proc.wait(1.0)  # a child that died is reaped at once; one that closed its end soon
            except subprocess.TimeoutExpired:
                pass
        return WorkerGone(f"the batch process ended ({f'exit status {code}' if code is not None else type(err).__name__})")

    def _call(self, message: Any, wait_s: float | None = None, kill_when_late: bool = False) -> Any:
        import select

        self._call_nowait(message)
        sock = self._sock
        assert sock is not None
        wait = wait_s if wait_s is not None else (_REPLY_WAIT_S if self._ready else _START_WAIT_S)
        try:
            while True:
                readable, _, _ = select.select([sock], [], [], wait)
                if not readable:
                    if kill_when_late and self._proc is not None:
                        self._proc.kill()
                        self._end(5.0)
                    raise WorkerGone(f"the batch process did not answer within {wait:g}s")
                reply = _receive(sock)
                if reply[0] == "ready":
                    self._ready = True
                    continue
                return reply[1]
        except (EOFError, OSError, pickle.UnpicklingError) as err:
            raise self._gone(err) from None

    def _parcel(self, session: Any, items: list[Any]) -> Parcel:
        from .torch_hooks import NativeOpRecorder

        shipped, signatures = [], {}
        for c in items:
            recorder, ops, key = c.op_recorder, c.ops, None
            if ops is not None:
                if isinstance(recorder, NativeOpRecorder):
                    key = id(recorder)
                    table = recorder.signature_table()
                    have = self._sent_signatures.get(key, 0)
                    if table.size > have or key not in self._sent_signatures:
                        signatures[key] = (table.scope_user, table.since(have))
                        self._sent_signatures[key] = table.size
                else:
                    ops, key = recorder.table([ops], session._pid, session._epoch), PREBUILT
            shipped.append(dataclasses.replace(c, ops=ops, op_recorder=key))
        sources = session.sources
        return Parcel(items=shipped, signatures=signatures, cupti=sources.take_cupti(max(c.end_ns for c in items)),
                      context={"resource": dict(session.resource), "job_id": session.job_id,
                               "devices": list(sources.devices), "label": sources.label(), "on_gpu": sources.on_gpu,
                               "has_cupti": sources.cupti is not None, "pid": session._pid, "epoch": session._epoch,
                               "cpu_spec": sources.cpu_spec_for_stitch(lambda: session.closed),
                               "cpu_price": sources.cpu_price_per_hour(), "cpu_threads": sources.cpu_threads(),
                               "closed": session.closed})


# ---- the child's side


class _Prebuilt:
    """Stands in for the dispatch hook's recorder: its chunks arrive as tables."""

    @staticmethod
    def table(chunks: list[Any], pid: int, epoch_offset_ns: int) -> Any:
        import pyarrow as pa

        return chunks[0] if len(chunks) == 1 else pa.concat_tables(chunks, promote_options="default")


class _ShippedSources:
    """What ``batches.process`` reads of the job's LiveSources, as the parcel brought it."""

    def __init__(self, parcel: Parcel) -> None:
        ctx = parcel.context
        self.devices = ctx["devices"]
        self.on_gpu = ctx["on_gpu"]
        self.cupti = True if ctx["has_cupti"] else None
        self._label = ctx["label"]
        self._cupti_now = parcel.cupti
        self._cpu_spec = ctx["cpu_spec"]
        self._cpu_price = ctx["cpu_price"]
        self._cpu_threads = ctx["cpu_threads"]

    def label(self) -> str:
        return self._label

    def take_cupti(self, cutoff_ns: int) -> Any:
        return self._cupti_now  # taken by the job's side at the same cutoff (the batch's last step end)

    def cpu_spec_for_stitch(self, closing: Any) -> Any:
        return self._cpu_spec

    def cpu_price_per_hour(self) -> float | None:
        return self._cpu_price

    def cpu_threads(self) -> int:
        return self._cpu_threads


class _ChildSession:
    """The part of a CaptureSession that ``batches.process`` reads and the batches leave each other."""

    def __init__(self, config: Any, resource: dict[str, Any]) -> None:
        from . import batches

        self.config = config
        self.resource = resource
        self.memory = batches.BatchMemory()
        self.job_id = str(resource.get("plasmient.job.id", ""))
        self.job_id_shared = True  # a multi-rank job keeps the in-process worker (handover)
        self.closed = False
        self.sources: Any = None
        self._pid = 0
        self._epoch = 0
        self._recorders: dict[Any, Any] = {PREBUILT: _Prebuilt()}

    def take(self, parcel: Parcel) -> list[Any]:
        """The parcel's steps, their op recorders replaced by the replicas that build their tables."""
        from .packed_tables import SignatureTable

        for key, (scope_user, new) in parcel.signatures.items():
            table = self._recorders.setdefault(key, SignatureTable(scope_user))
            if new and new[0]:
                table.extend(new)
        ctx = parcel.context
        self.resource, self.job_id, self.closed = ctx["resource"], ctx["job_id"], ctx["closed"]
        self._pid, self._epoch = ctx["pid"], ctx["epoch"]
        self.sources = _ShippedSources(parcel)
        return [dataclasses.replace(c, op_recorder=self._recorders[c.op_recorder]) if c.op_recorder is not None
                else c for c in parcel.items]


def _serve(parent: socket.socket) -> int:
    from . import batches, config as config_mod

    kind, init = _receive(parent)
    if kind != "init":
        return 2
    config = init["config"]
    # what a batch needs, imported before the first one, so its CPU time (which the full-depth budget charges
    # to full steps) is the stitch's, not the imports'
    from .. import pipeline  # noqa: F401
    from ..export import otlp_json  # noqa: F401
    from ..stitch import step_facts  # noqa: F401
    from . import kineto_fallback, session as _session  # noqa: F401 - the steps' class, the fallback's reader

    session = _ChildSession(config, init["resource"])
    delivery = config_mod.build_delivery(config, init["resource"], None)
    config_mod.say_where(delivery, session.job_id)
    _send(parent, ("ready", None))
    while True:
        try:
            kind, body = _receive(parent)
        except (EOFError, OSError):  # the job ended without a close (a reset if it left our "ready" unread):
            kind, body = "ended", config.flush_timeout_s  # deliver what arrived, within the usual flush time
        if kind == "batch":
            cpu = time.process_time()
            reply: dict[str, Any] = {"error": None}
            session.memory.want_full = False
            try:
                delivery.submit(batches.process(session, session.take(body)))
            except Exception as err:
                reply["error"] = f"{type(err).__name__}: {err}"
            reply.update(want_full=session.memory.want_full, local_errors=delivery.stats.local_errors,
                         cpu_s=time.process_time() - cpu)
            _send(parent, ("done", reply))
            continue
        # handover, close, or the job's end: deliver what is held within ``body`` seconds, answer, end
        delivery.shutdown(body)
        config_mod.report_delivery(delivery.stats)
        if kind == "handover":
            _send(parent, ("memory", {"memory": session.memory}))
        elif kind == "close":
            _send(parent, ("closed", {}))
        return 0


def main(argv: list[str]) -> int:
    # The job's Ctrl-C and its scheduler's SIGTERM reach this process too; the job's handling of them
    # closes the capture, which is what ends this process, after the last batch is delivered.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        return _serve(socket.socket(fileno=int(argv[0])))
    except (EOFError, OSError):
        return 0  # the job ended before the first batch, or stopped reading
    except Exception as err:  # never a traceback in the job's stderr: one line, as the job's side says its own
        from .config import say_once

        say_once("batch-process-failed", f"the batch process failed ({type(err).__name__}: {err}); the job's "
                                         "steps from its last batch on are stitched in the job's process")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
