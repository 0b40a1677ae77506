"""Offline source: a Kineto / torch.profiler Chrome-trace file (.json or .json.gz) -> RecordSet.

Reads the variants found in the wild: CUDA and ROCm/HIP runtimes, old (V100-era 'Kernel'/'Runtime'/
'Operator') and current ('kernel'/'cuda_runtime'/'cpu_op') category names, CUDA graphs, NCCL/RCCL,
with or without ProfilerStep#N, python_function/nn.Module events and Input Dims, and CPU-only traces.

Memory: the file is decompressed into one buffer, parsed once with orjson, the buffer is dropped, and
one pass over the events fills plain column lists; the event dicts are dropped before the Arrow tables
are built. No event is copied twice.

Bad input never produces a traceback: every problem is a :class:`TraceFormatError` whose message is one
line naming the file and what is wrong.
"""

from __future__ import annotations

import gzip
import io
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from ..records import DeviceInfo, RecordSet, table_from_columns


class TraceFormatError(ValueError):
    """The input is not a readable Kineto Chrome trace. str(err) is a one-line message."""


_KERNEL_CATS = {"kernel": "kernel", "Kernel": "kernel", "gpu_memcpy": "memcpy", "Memcpy": "memcpy",
                "gpu_memset": "memset", "Memset": "memset"}
_LAUNCH_CATS = {"cuda_runtime", "Runtime", "cuda_driver", "Driver"}
_OP_CATS = {"cpu_op": "cpu_op", "Operator": "cpu_op", "user_annotation": "user_annotation"}
_MODULE_PREFIX = "nn.Module: "
_STEP_PREFIX = "ProfilerStep#"
# Kineto writes epoch microseconds (>= 2001-09-09) when it has no baseTimeNanoseconds anchor.
_EPOCH_US_THRESHOLD = 1.0e15


def _read_bytes(path: Path) -> bytes:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceFormatError(f"{path}: is a directory, expected a trace file") from None
    except OSError as err:
        raise TraceFormatError(f"{path}: cannot read ({err.strerror or err})") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            with gzip.GzipFile(fileobj=io.BytesIO(raw)) as gz:
                raw = gz.read()
        except EOFError:
            raise TraceFormatError(f"{path}: truncated gzip stream (the file was cut short)") from None
        except (OSError, zlib.error) as err:
            raise TraceFormatError(f"{path}: corrupt gzip data ({err})") from None
    if not raw.strip():
        raise TraceFormatError(f"{path}: file is empty")
    return raw


def _parse_json(path: Path, raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        head = raw.lstrip()[:1]
        if head not in (b"{", b"["):
            raise TraceFormatError(f"{path}: not JSON (a Kineto Chrome trace starts with '{{')") from None
        raise TraceFormatError(f"{path}: invalid or truncated JSON ({err.msg} at byte {err.pos})") from None


def _as_int(value: Any) -> int:
    """pid/tid are ints in current Kineto, strings ('25738', 'stream 7') in older files."""
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    if isinstance(value, str):
        digits = value.rsplit(" ", 1)[-1]
        if digits.lstrip("-").isdigit():
            return int(digits)
        return zlib.crc32(value.encode())
    return -1


def _to_ns(ts: list[Any], base_ns: int) -> np.ndarray:
    """Kineto µs floats/ints -> int64 ns, without losing the integer part to float64 rounding."""
    if not ts:
        return np.zeros(0, dtype=np.int64)
    us = np.asarray(ts, dtype=np.float64)
    origin = float(np.floor(us.min()))
    return np.rint((us - origin) * 1000.0).astype(np.int64) + (int(origin) * 1000 + base_ns)


def _dur_ns(dur: list[Any]) -> np.ndarray:
    return np.rint(np.asarray(dur, dtype=np.float64) * 1000.0).astype(np.int64)


def _dims3(value: Any) -> list[int] | None:
    if isinstance(value, list) and len(value) == 3:
        return [int(v) for v in value]
    return None


def read_kineto(path: str | Path) -> RecordSet:
    """Parse one Kineto trace file into a RecordSet (one process/rank)."""
    path = Path(path)
    raw = _read_bytes(path)
    doc = _parse_json(path, raw)
    del raw
    if isinstance(doc, list):
        events, meta = doc, {}
    elif isinstance(doc, dict):
        if "traceEvents" not in doc:
            keys = ", ".join(list(doc)[:5]) or "none"
            raise TraceFormatError(f"{path}: not a Chrome trace (no 'traceEvents'; top-level keys: {keys})")
        events, meta = doc["traceEvents"], doc
    else:
        raise TraceFormatError(f"{path}: not a Chrome trace (top level is {type(doc).__name__})")
    if not isinstance(events, list):
        raise TraceFormatError(f"{path}: 'traceEvents' is {type(events).__name__}, expected a list")
    if not events:
        raise TraceFormatError(f"{path}: trace contains no events")
    try:
        return _records_from_events(path, events, meta)
    finally:
        del events, doc


def _records_from_events(path: Path, events: list[Any], meta: dict[str, Any]) -> RecordSet:
    k_dev: list[int] = []; k_stream: list[int] = []; k_ts: list[Any] = []; k_dur: list[Any] = []
    k_name: list[str] = []; k_kind: list[str] = []; k_corr: list[Any] = []; k_ext: list[Any] = []
    k_grid: list[Any] = []; k_block: list[Any] = []; k_regs: list[Any] = []; k_smem: list[Any] = []
    k_graph: list[Any] = []; k_bytes: list[Any] = []
    l_pid: list[int] = []; l_tid: list[int] = []; l_ts: list[Any] = []; l_dur: list[Any] = []
    l_name: list[str] = []; l_corr: list[int] = []; l_ext: list[Any] = []
    o_pid: list[int] = []; o_tid: list[int] = []; o_ts: list[Any] = []; o_dur: list[Any] = []
    o_name: list[str] = []; o_cat: list[str] = []; o_ext: list[Any] = []; o_seq: list[Any] = []
    o_fwd: list[Any] = []; o_dims: list[Any] = []; o_types: list[Any] = []; o_flops: list[Any] = []
    o_conc: list[Any] = []
    m_pid: list[int] = []; m_tid: list[int] = []; m_ts: list[Any] = []; m_dur: list[Any] = []; m_name: list[str] = []
    s_step: list[int] = []; s_ts: list[Any] = []; s_dur: list[Any] = []; s_name: list[str] = []
    dumps = orjson.dumps

    index = -1
    try:
        for index, e in enumerate(events):
            if e.get("ph") != "X":
                continue
            cat = e.get("cat")
            name = e["name"]
            if cat in _OP_CATS:
                if name.startswith(_STEP_PREFIX):
                    tail = name[len(_STEP_PREFIX):]
                    if tail.isdigit():
                        s_step.append(int(tail)); s_ts.append(e["ts"]); s_dur.append(e["dur"]); s_name.append(name)
                        continue
                args = e.get("args") or {}
                o_pid.append(_as_int(e.get("pid"))); o_tid.append(_as_int(e.get("tid")))
                o_ts.append(e["ts"]); o_dur.append(e["dur"]); o_name.append(name); o_cat.append(_OP_CATS[cat])
                o_ext.append(args.get("External id", args.get("external id")))
                o_seq.append(args.get("Sequence number")); o_fwd.append(args.get("Fwd thread id"))
                dims = args.get("Input Dims")
                o_dims.append(dumps(dims).decode() if dims is not None else None)
                types = args.get("Input type")
                o_types.append(dumps(types).decode() if types is not None else None)
                o_flops.append(args.get("flops"))
                concrete = args.get("Concrete Inputs")
                o_conc.append(dumps(concrete).decode() if concrete is not None else None)
            elif cat in _KERNEL_CATS:
                args = e.get("args") or {}
                kind = _KERNEL_CATS[cat]
                if kind == "kernel" and ("nccl" in name or "rccl" in name or "Nccl" in name):
                    kind = "collective"
                k_dev.append(_as_int(args.get("device", e.get("pid"))))
                k_stream.append(_as_int(args.get("stream", e.get("tid"))))
                k_ts.append(e["ts"]); k_dur.append(e["dur"]); k_name.append(name); k_kind.append(kind)
                k_corr.append(args.get("correlation")); k_ext.append(args.get("External id", args.get("external id")))
                k_grid.append(_dims3(args.get("grid"))); k_block.append(_dims3(args.get("block")))
                k_regs.append(args.get("registers per thread")); k_smem.append(args.get("shared memory"))
                k_graph.append(args.get("graph id")); k_bytes.append(args.get("bytes"))
            elif cat in _LAUNCH_CATS:
                args = e.get("args") or {}
                corr = args.get("correlation")
                if corr is None:
                    continue
                l_pid.append(_as_int(e.get("pid"))); l_tid.append(_as_int(e.get("tid")))
                l_ts.append(e["ts"]); l_dur.append(e["dur"]); l_name.append(name); l_corr.append(corr)
                l_ext.append(args.get("External id", args.get("external id")))
            elif cat == "python_function" and name.startswith(_MODULE_PREFIX):
                m_pid.append(_as_int(e.get("pid"))); m_tid.append(_as_int(e.get("tid")))
                m_ts.append(e["ts"]); m_dur.append(e["dur"]); m_name.append(name[len(_MODULE_PREFIX):])
    except (KeyError, TypeError, AttributeError) as err:
        what = repr(err.args[0]) if isinstance(err, KeyError) else str(err)
        event = events[index] if 0 <= index < len(events) else None
        label = f"{event.get('cat')} {str(event.get('name'))[:60]!r}" if isinstance(event, dict) else repr(event)[:60]
        problem = f"missing field {what}" if isinstance(err, KeyError) else f"malformed event ({what})"
        raise TraceFormatError(f"{path}: event #{index} ({label}): {problem}") from None

    base_ns, clock = _clock_anchor(meta, [k_ts, l_ts, o_ts, s_ts, m_ts])
    try:
        records = RecordSet(source=str(path), clock=clock)
        k_start = _to_ns(k_ts, base_ns)
        records.kernels = table_from_columns("kernels", {
            "device": k_dev, "stream": k_stream, "start_ns": k_start, "end_ns": k_start + _dur_ns(k_dur),
            "name": k_name, "kind": k_kind, "correlation_id": k_corr, "external_id": k_ext,
            "grid": k_grid, "block": k_block, "registers_per_thread": k_regs, "shared_memory": k_smem,
            "graph_id": k_graph, "bytes": k_bytes,
        }) if k_ts else records.kernels
        l_start = _to_ns(l_ts, base_ns)
        records.launches = table_from_columns("launches", {
            "pid": l_pid, "tid": l_tid, "start_ns": l_start, "end_ns": l_start + _dur_ns(l_dur),
            "name": l_name, "correlation_id": l_corr, "external_id": l_ext,
        }) if l_ts else records.launches
        o_start = _to_ns(o_ts, base_ns)
        records.ops = table_from_columns("ops", {
            "pid": o_pid, "tid": o_tid, "start_ns": o_start, "end_ns": o_start + _dur_ns(o_dur),
            "name": o_name, "category": o_cat, "external_id": o_ext, "sequence_number": o_seq,
            "fwd_thread_id": o_fwd, "input_dims": o_dims, "input_types": o_types,
            "kineto_flops": [None if f is None else float(f) for f in o_flops],
            "concrete_inputs": o_conc,
        }) if o_ts else records.ops
        m_start = _to_ns(m_ts, base_ns)
        records.modules = table_from_columns("modules", {
            "pid": m_pid, "tid": m_tid, "start_ns": m_start, "end_ns": m_start + _dur_ns(m_dur),
            "name": m_name, "phase": ["forward"] * len(m_name),
        }) if m_ts else records.modules
        s_start = _to_ns(s_ts, base_ns)
        records.steps = table_from_columns("steps", {
            "step": s_step, "start_ns": s_start, "end_ns": s_start + _dur_ns(s_dur), "name": s_name,
        }) if s_ts else records.steps
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as err:
        raise TraceFormatError(f"{path}: unexpected field types ({str(err).splitlines()[0][:160]})") from None

    records.devices = _devices(meta)
    records.resource = _resource(meta, o_pid or l_pid)
    return records


def _clock_anchor(meta: dict[str, Any], ts_lists: list[list[Any]]) -> tuple[int, str]:
    base = meta.get("baseTimeNanoseconds")
    if isinstance(base, (int, float)) and base > 0:
        return int(base), "epoch"
    first = next((lst[0] for lst in ts_lists if lst), None)
    if isinstance(first, (int, float)) and first >= _EPOCH_US_THRESHOLD:
        return 0, "epoch"
    return 0, "relative"


def _devices(meta: dict[str, Any]) -> list[DeviceInfo]:
    out = []
    for props in meta.get("deviceProperties") or []:
        if not isinstance(props, dict) or "name" not in props:
            continue
        out.append(DeviceInfo(
            ordinal=_as_int(props.get("id", len(out))), name=str(props["name"]),
            sm_count=props.get("numSms"), memory_bytes=props.get("totalGlobalMem"),
            properties=dict(props),
        ))
    return out


def _resource(meta: dict[str, Any], pids: list[int]) -> dict[str, Any]:
    resource: dict[str, Any] = {}
    dist = meta.get("distributedInfo")
    if isinstance(dist, dict):
        if isinstance(dist.get("rank"), int):
            resource["plasmient.rank"] = dist["rank"]
        if isinstance(dist.get("world_size"), int):
            resource["plasmient.world_size"] = dist["world_size"]
        if isinstance(dist.get("backend"), str):
            resource["plasmient.distributed.backend"] = dist["backend"]
    if pids:
        values, counts = np.unique(np.asarray(pids, dtype=np.int64), return_counts=True)
        resource["process.pid"] = int(values[np.argmax(counts)])
    return resource
