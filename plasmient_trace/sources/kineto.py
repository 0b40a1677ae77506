"""Offline source: a Kineto / torch.profiler Chrome-trace file (.json or .json.gz) -> RecordSet.

Reads the variants found in the wild: CUDA and ROCm/HIP runtimes, old (V100-era 'Kernel'/'Runtime'/
'Operator') and current ('kernel'/'cuda_runtime'/'cpu_op') category names, CUDA graphs, NCCL/RCCL,
with or without ProfilerStep#N, python_function/nn.Module events and Input Dims, Inductor's per-kernel
``kernel_flop`` / ``kernel_num_gb``, and CPU-only traces.

Memory: the file is gunzipped into one exactly-sized buffer under a size cap (``rawinput``) and split
into per-event Raw views; one pass decodes each event alone into a small typed Struct holding only the
fields used here (``kineto_schema``) and appends it to the columns (typed arrays for times and ids).
The buffer goes when the pass ends. Times are then checked (``validate``): impossible values are dropped
or clamped and counted in ``RecordSet.counters``, before any Arrow table is built.

Bad input never produces a traceback: every problem is a :class:`TraceFormatError` whose message is one
line naming the file and what is wrong.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc
from msgspec import UNSET

from ..memory import LARGE_ROWS, cyclic_gc_paused, release_arrow_cache, trim_heap
from ..records import TABLE_SCHEMAS, RecordSet, is_collective_kernel, table_from_columns
from .event_chunks import EventChunks, Unstreamable
from .kineto_meta import INT64_MAX, as_int, clock_anchor, devices_of, resource_of
from .kineto_schema import (
    DOCUMENT,
    EVENT,
    TOP_LEVEL_KEYS,
    KinetoArgs,
    KinetoEvent,
    MalformedEvent,
    malformed_event,
)
from .rawinput import InputError, inflate_whole, is_gzip, read_file_bytes
from .validate import TimeChecker

_dumps = orjson.dumps
_DIMS3 = pa.list_(pa.int32(), 3)


class TraceFormatError(ValueError):
    """The input is not a readable Kineto Chrome trace. str(err) is a one-line message."""


_KERNEL_CATS = {"kernel": "kernel", "Kernel": "kernel", "gpu_memcpy": "memcpy", "Memcpy": "memcpy",
                "gpu_memset": "memset", "Memset": "memset"}
_LAUNCH_CATS = {"cuda_runtime", "Runtime", "cuda_driver", "Driver"}
_OP_CATS = {"cpu_op": "cpu_op", "Operator": "cpu_op", "user_annotation": "user_annotation"}
_MODULE_PREFIX = "nn.Module: "
_STEP_PREFIX = "ProfilerStep#"


def _emptiness(path: Path) -> str:
    """What is empty: the file, or the gzip stream in it (a valid .gz of nothing is not cut short)."""
    try:
        whole_file = Path(path).stat().st_size == 0
    except OSError:
        whole_file = True
    return "file is empty" if whole_file or not str(path).endswith(".gz") else "its gzip stream decompresses to nothing"


def _wide_encoding(head: bytes) -> str | None:
    """UTF-16 or UTF-32, from a byte order mark or from NULs beside the opening '{' (JSON must be UTF-8)."""
    for bom, name in ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
                      (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16")):
        if head.startswith(bom):
            return name
    if head in (b"{\x00\x00\x00", b"\x00\x00\x00{"):
        return "UTF-32"
    if head[:2] in (b"{\x00", b"\x00{"):
        return "UTF-16"
    return None


def _decode(path: Path, raw: bytes) -> tuple[list[msgspec.Raw], dict[str, Any]]:
    """Split the document into per-event Raw views and the metadata; failures are one line each."""
    if len(raw) == 0 or (not bytes(raw[:65536]).strip() and not raw.strip()):
        raise TraceFormatError(f"{path}: {_emptiness(path)}")
    if bytes(raw[:3]) == b"\xef\xbb\xbf":
        raw = raw[3:]  # a UTF-8 byte order mark (a trace saved by a Windows editor): JSON allows ignoring it
    try:
        doc = DOCUMENT.decode(raw)
    except msgspec.ValidationError as err:
        raise TraceFormatError(f"{path}: {_structure_problem(str(err))}") from None
    except msgspec.DecodeError as err:
        wide = _wide_encoding(bytes(raw[:4]))
        if wide:
            raise TraceFormatError(f"{path}: {wide} text, not UTF-8 JSON (save the trace as UTF-8)") from None
        head = bytes(raw[:65536]).lstrip()[:1]
        if head not in (b"{", b"["):
            raise TraceFormatError(f"{path}: not JSON (a Kineto Chrome trace starts with '{{')") from None
        raise TraceFormatError(f"{path}: {_span_file(raw) or f'invalid or truncated JSON ({err})'}") from None
    except MemoryError:
        raise TraceFormatError(f"{path}: not enough memory to decode the trace") from None
    except RecursionError:
        raise TraceFormatError(f"{path}: JSON nested too deeply to be a Kineto trace") from None
    if isinstance(doc, list):
        return doc, {}
    if doc.traceEvents is msgspec.UNSET:
        keys = ", ".join(list(TOP_LEVEL_KEYS.decode(raw))[:5]) or "none"
        not_chrome = f"not a Chrome trace (no 'traceEvents'; top-level keys: {keys})"
        raise TraceFormatError(f"{path}: {_span_file(raw) or not_chrome}")
    meta = {"deviceProperties": doc.deviceProperties, "baseTimeNanoseconds": doc.baseTimeNanoseconds,
            "distributedInfo": doc.distributedInfo}
    return doc.traceEvents, meta


def _span_file(raw: bytes) -> str | None:
    """What to say when the input is plasmient's own output (OTLP JSON lines) rather than a trace."""
    if bytes(raw[:4096]).lstrip().startswith(b'{"resourceSpans"'):
        return "a span file (OTLP JSON lines, what plasmient writes), not a trace: read it with `plasmient report`"
    return None


_JSON_TYPES = {"int": "int", "float": "float", "str": "str", "bool": "bool", "null": "None"}


def _structure_problem(message: str) -> str:
    """msgspec's 'Expected `array`, got `object` - at `$.traceEvents`' in this project's words."""
    what, _, where = message.partition(" - at ")
    where = where.strip("`")
    if not where:
        got = what.rsplit("got ", 1)[-1].strip("`")
        return f"not a Chrome trace (top level is {_JSON_TYPES.get(got, got)})"
    if where == "$.traceEvents":
        got = what.rsplit("got ", 1)[-1].strip("`")
        return f"'traceEvents' is {got}, expected a list"
    return f"malformed trace ({what} at {where})"


def _id(value: Any) -> int:
    """as_int with the common case (an int64 int) answered without a second call."""
    return value if value.__class__ is int and -INT64_MAX <= value <= INT64_MAX else as_int(value)


def _dims3_column(values: list[Any]) -> pa.Array | list[list[int] | None]:
    """grid/block: Arrow converts a column of [x, y, z] int lists at once; anything else goes value by value."""
    try:
        return pa.array(values, _DIMS3)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
        return [_dims3(v) for v in values]


def _dims3(value: Any) -> list[int] | None:
    if isinstance(value, list) and len(value) == 3:
        return [int(v) for v in value]
    return None


def _json_text(value: Any) -> str | None:
    return None if value is None else _dumps(value).decode()


_ANY = msgspec.json.Decoder()
_NO_TEXT: tuple[str | None, Any] = (None, None)
# What the per-file caches remember, in bytes of their keys: real traces hold a few hundred KB of distinct
# argument lists and kernel names; a hostile file of millions of distinct long ones parses the rest each time
# instead of holding them twice (the record tables keep the texts anyway).
_CACHE_KEY_BYTES = 4 << 20


class _ArgTexts:
    """An op argument list's JSON text as the record tables keep it (compact, as orjson prints it) and its
    value, parsed once per distinct raw text of the file: a trace repeats a few thousand of them."""

    def __init__(self) -> None:
        self._seen: dict[bytes, tuple[str | None, Any]] = {}
        self._room = _CACHE_KEY_BYTES

    def __call__(self, raw: msgspec.Raw | None) -> tuple[str | None, Any]:
        if raw is None:
            return _NO_TEXT
        key = bytes(raw)
        got = self._seen.get(key)
        if got is None:
            value = _ANY.decode(key)
            got = (_json_text(value), value)
            if len(key) <= self._room:
                self._seen[key] = got
                self._room -= len(key)
        return got


def _broadcast_strides(strides: Any, dims: Any) -> str | None:
    """'Input Strides' as JSON text when some input is broadcast (a stride 0 over a dimension longer than 1,
    as ``expand`` makes), else None: dense inputs need no strides, and most ops have none of them."""
    if type(strides) is not list or type(dims) is not list:
        return None
    for st, d in zip(strides, dims):
        if type(st) is list and 0 in st and type(d) is list and len(d) == len(st) \
                and any(k == 0 and type(n) is int and n > 1 for k, n in zip(st, d)):
            return _json_text(strides)
    return None


def _ext(args: KinetoArgs) -> Any:
    return args.external_id_lower if args.external_id is UNSET else args.external_id


def _gb_to_bytes(value: Any) -> float | None:
    return None if value is None else float(value) * 1e9


_NO_ARGS = KinetoArgs()


def read_kineto(path: str | Path) -> RecordSet:
    """Parse one Kineto trace file into a RecordSet (one process/rank)."""
    path = Path(path)
    try:
        data = read_file_bytes(path)
    except InputError as err:
        raise TraceFormatError(str(err)) from None
    # The column pass keeps ~10 tracked objects per event (list items, grid lists) and frees none.
    with cyclic_gc_paused():
        columns = meta = raw = None
        if is_gzip(data):  # inflated a block at a time: a large document never exists at once
            try:
                chunks = EventChunks(data, path)
                if chunks.whole is not None:
                    raw = chunks.whole
                else:
                    columns, meta = _collect_chunks(path, chunks)
                    del chunks, data  # the compressed bytes too: the tables are built without them
            except Unstreamable:
                pass  # read whole below, which names the problem if there is one
            except MalformedEvent as err:  # named where the streamed read found it, as _collect names one
                raise TraceFormatError(f"{path}: {err}") from None
        if columns is None or meta is None:
            if raw is None:
                try:
                    raw = inflate_whole(path, data)
                except InputError as err:
                    raise TraceFormatError(str(err)) from None
            del data
            events, meta = _decode(path, raw)
            del raw
            if not events:
                raise TraceFormatError(f"{path}: trace contains no events")
            columns = _collect(path, events)
            del events
    return _build(path, columns, meta)


def _collect_chunks(path: Path, chunks: EventChunks) -> tuple[_Columns, dict[str, Any] | None]:
    columns = _Columns()
    seen = 0
    for events in chunks:
        _collect(path, events, columns, seen, decoded=True)
        seen += len(events)
        del events  # before the next chunk is inflated and cut
        columns.compact()
    if not seen:
        raise TraceFormatError(f"{path}: trace contains no events")
    trim_heap()  # before the tables are built (Arrow's own cache is reused by them)
    return columns, chunks.meta


_FLOAT_COLUMNS = ("ts", "dur")
# Kernel columns of the NCCL/RCCL message metadata, with the least valid value of the integer ones.
_COMM_COLUMNS = ("comm_collective", "comm_in_nelems", "comm_out_nelems", "comm_group_size", "comm_dtype",
                 "comm_process_group")
_COMM_MINIMUM = {"comm_in_nelems": 0, "comm_out_nelems": 0, "comm_group_size": 1}
_INT_COLUMNS = ("pid", "tid", "device", "stream")
# Converted by _build with checks of their own (and counted when invalid), never compacted.
_BUILT_APART = frozenset({"kineto_flops", "model_flops", "model_bytes", *_COMM_COLUMNS})


def _column(name: str) -> Any:
    # Times and ids go into typed arrays (8 bytes a value, not a 32-byte float or int object plus a list
    # slot): the columns are most of the parse's memory after the file's own bytes.
    if name in _FLOAT_COLUMNS:
        return array("d")
    if name in _INT_COLUMNS:
        return array("q")
    return []


class _Columns:
    """Per-table columns (typed arrays for times and ids, lists otherwise), filled in file order by one
    pass over the events."""

    def __init__(self) -> None:
        self.kernels: dict[str, Any] = {k: _column(k) for k in (
            "ts", "dur", "device", "stream", "name", "kind", "correlation_id", "external_id", "grid", "block",
            "registers_per_thread", "shared_memory", "graph_id", "bytes", "model_flops", "model_bytes",
            *_COMM_COLUMNS)}
        self.launches: dict[str, Any] = {k: _column(k) for k in (
            "ts", "dur", "pid", "tid", "name", "correlation_id", "external_id")}
        self.ops: dict[str, Any] = {k: _column(k) for k in (
            "ts", "dur", "pid", "tid", "name", "category", "external_id", "sequence_number", "fwd_thread_id",
            "input_dims", "input_types", "kineto_flops", "concrete_inputs", "input_strides")}
        self.modules: dict[str, Any] = {k: _column(k) for k in ("ts", "dur", "pid", "tid", "name")}
        self.steps: dict[str, Any] = {k: _column(k) for k in ("ts", "dur", "step", "name", "pid", "tid")}
        self.arrow: dict[tuple[str, str], list[pa.Array]] = {}  # (table, column) -> compacted chunks
        self.loose: set[tuple[str, str]] = set()  # columns left as lists
        # per kernel name, whether it is a collective's: a trace repeats a few hundred names across all
        # of its chunks, and the pattern search costs a long template name's length
        self.collective_names: dict[str, bool] = {}
        self.name_room = _CACHE_KEY_BYTES  # characters collective_names may still take
        self.arg_texts = _ArgTexts()

    def tables(self) -> dict[str, dict[str, Any]]:
        return {"kernels": self.kernels, "launches": self.launches, "ops": self.ops, "modules": self.modules,
                "steps": self.steps}

    def compact(self) -> None:
        """Move what the list columns hold into Arrow arrays of their record-table type: a name or an id
        then costs its bytes, not a Python object (about 50 bytes) and a list slot. Called between chunks
        of a streamed read; a column Arrow refuses stays a list, converted by ``_build`` as before."""
        arrow, loose = self.arrow, self.loose
        for table, cols in self.tables().items():
            schema = TABLE_SCHEMAS[table]
            for name, values in cols.items():
                key = (table, name)
                if not values or not isinstance(values, list) or name in _BUILT_APART or key in loose:
                    continue
                try:
                    chunk = pa.array(values, schema.field(name).type)
                except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError, KeyError):
                    loose.add(key)  # e.g. a value only a dropped event holds: _build filters before converting
                    values[:0] = [v for done in arrow.pop(key, []) for v in done.to_pylist()]
                    continue
                arrow.setdefault(key, []).append(chunk)
                values.clear()

    def column(self, table: str, name: str, values: Any) -> Any:
        """A column as ``_build`` converts it: its compacted Arrow chunks, or its list."""
        chunks = self.arrow.pop((table, name), None)  # let go as soon as it is one array
        if not chunks:
            return values
        if values:
            chunks = [*chunks, pa.array(values, chunks[0].type)]
        return pa.concat_arrays(chunks) if len(chunks) > 1 else chunks[0]


def _collect(path: Path, events: list[msgspec.Raw] | list[KinetoEvent], cols: _Columns | None = None,
             first: int = 0, decoded: bool = False) -> _Columns:
    """Append the events' fields to the columns (new ones when None); ``first`` numbers them in errors.
    ``events`` are raw views decoded here one at a time, or already decoded (``decoded``)."""
    cols = _Columns() if cols is None else cols
    K, L, O, M, S = cols.kernels, cols.launches, cols.ops, cols.modules, cols.steps
    k_ts, k_dur, k_dev, k_stream, k_name, k_kind = K["ts"], K["dur"], K["device"], K["stream"], K["name"], K["kind"]
    k_corr, k_ext, k_grid, k_block, k_regs = K["correlation_id"], K["external_id"], K["grid"], K["block"], K["registers_per_thread"]
    k_smem, k_graph, k_bytes, k_mflops, k_mbytes = K["shared_memory"], K["graph_id"], K["bytes"], K["model_flops"], K["model_bytes"]
    k_coll, k_in, k_out, k_group, k_cdtype, k_pg = (K[k] for k in _COMM_COLUMNS)
    l_ts, l_dur, l_pid, l_tid, l_name, l_corr, l_ext = (L[k] for k in L)
    o_ts, o_dur, o_pid, o_tid, o_name, o_cat, o_ext, o_seq, o_fwd, o_dims, o_types, o_flops, o_conc, o_strides = (
        O[k] for k in O)
    m_ts, m_dur, m_pid, m_tid, m_name = (M[k] for k in M)
    s_ts, s_dur, s_step, s_name, s_pid, s_tid = (S[k] for k in S)
    index = first - 1
    e = None
    decode = EVENT.decode
    collective_names, arg_texts = cols.collective_names, cols.arg_texts
    try:
        for index, raw in enumerate(events, first):
            e = raw if decoded else decode(raw)
            if e.ph != "X":
                continue
            cat = e.cat
            name = e.name
            if cat in _OP_CATS:
                if name.startswith(_STEP_PREFIX):
                    tail = name[len(_STEP_PREFIX):]
                    if tail.isdigit():
                        s_step.append(int(tail)); s_ts.append(e.ts); s_dur.append(e.dur); s_name.append(name)
                        s_pid.append(_id(e.pid)); s_tid.append(_id(e.tid))
                        continue
                a = e.args or _NO_ARGS
                o_pid.append(_id(e.pid)); o_tid.append(_id(e.tid))
                o_ts.append(e.ts); o_dur.append(e.dur); o_name.append(name); o_cat.append(_OP_CATS[cat])
                o_ext.append(_ext(a)); o_seq.append(a.sequence_number); o_fwd.append(a.fwd_thread_id)
                dims_text, dims = arg_texts(a.input_dims)
                o_dims.append(dims_text); o_types.append(arg_texts(a.input_types)[0])
                o_flops.append(None if a.flops is None else float(a.flops))
                o_conc.append(arg_texts(a.concrete_inputs)[0])
                o_strides.append(_broadcast_strides(arg_texts(a.input_strides)[1], dims))
            elif cat in _KERNEL_CATS:
                a = e.args or _NO_ARGS
                kind = _KERNEL_CATS[cat]
                if kind == "kernel":
                    collective = collective_names.get(name)
                    if collective is None:
                        collective = is_collective_kernel(name)
                        if cols.name_room >= len(name):
                            collective_names[name] = collective
                            cols.name_room -= len(name)
                    if collective:
                        kind = "collective"
                k_dev.append(_id(e.pid if a.device is UNSET else a.device))
                k_stream.append(_id(e.tid if a.stream is UNSET else a.stream))
                k_ts.append(e.ts); k_dur.append(e.dur); k_name.append(name); k_kind.append(kind)
                k_corr.append(a.correlation); k_ext.append(_ext(a))
                k_grid.append(a.grid); k_block.append(a.block)
                k_regs.append(a.registers_per_thread); k_smem.append(a.shared_memory)
                k_graph.append(a.graph_id); k_bytes.append(a.bytes)
                k_mflops.append(None if a.kernel_flop is None else float(a.kernel_flop))
                k_mbytes.append(_gb_to_bytes(a.kernel_num_gb))
                k_coll.append(a.collective_name); k_in.append(a.in_msg_nelems); k_out.append(a.out_msg_nelems)
                k_group.append(a.group_size); k_cdtype.append(a.comm_dtype); k_pg.append(a.process_group_name)
            elif cat in _LAUNCH_CATS:
                a = e.args or _NO_ARGS
                corr = a.correlation
                if corr is None:
                    continue
                l_pid.append(_id(e.pid)); l_tid.append(_id(e.tid))
                l_ts.append(e.ts); l_dur.append(e.dur); l_name.append(name); l_corr.append(corr)
                l_ext.append(_ext(a))
            elif cat == "python_function" and name.startswith(_MODULE_PREFIX):
                m_pid.append(_id(e.pid)); m_tid.append(_id(e.tid))
                m_ts.append(e.ts); m_dur.append(e.dur); m_name.append(name[len(_MODULE_PREFIX):])
    except msgspec.ValidationError as err:
        raise TraceFormatError(f"{path}: {malformed_event(err, index, in_list=False)}") from None
    except msgspec.DecodeError as err:
        # the event at ``index`` did not decode: ``e`` is still the one before it, so no label
        raise TraceFormatError(f"{path}: event #{index}: malformed event ({err})") from None
    except RecursionError:
        raise TraceFormatError(f"{path}: event #{index}: nested too deeply to be a Kineto event") from None
    except (TypeError, AttributeError, ValueError, OverflowError) as err:
        if e is None:
            raise TraceFormatError(f"{path}: event #{index}: malformed event ({err})") from None
        label = f"{e.cat} {str(e.name)[:60]!r}"
        raise TraceFormatError(f"{path}: event #{index} ({label}): {_event_problem(e, err)}") from None
    return cols


def _event_problem(e: KinetoEvent, err: Exception) -> str:
    """Name the field that stopped the column pass: a missing one, or a time that is not a number."""
    for field in ("name", "ts", "dur"):
        if getattr(e, field) is None:
            return f"missing field {field!r}"
    for field in ("ts", "dur"):
        value = getattr(e, field)
        if not isinstance(value, (int, float)) or isinstance(err, OverflowError):
            return f"unexpected field types ({field!r} is {type(value).__name__}: {str(value)[:40]!r})"
    return f"malformed event ({err})"


def _times(values: array) -> np.ndarray:
    """µs column -> float64 array (a view of the typed array, no copy)."""
    return np.frombuffer(values, dtype=np.float64) if len(values) else np.zeros(0, np.float64)


def _to_ns(us: np.ndarray, base_ns: int) -> np.ndarray:
    """Kineto µs floats/ints -> int64 ns, without losing the integer part to float64 rounding."""
    if not len(us):
        return np.zeros(0, dtype=np.int64)
    origin = float(np.floor(us.min()))
    return np.rint((us - origin) * 1000.0).astype(np.int64) + (int(origin) * 1000 + base_ns)


def _build(path: Path, columns: _Columns, meta: dict[str, Any]) -> RecordSet:
    tables = columns.tables()
    pids = columns.ops["pid"] or columns.launches["pid"]  # kept past the clearing of the columns below
    times = {name: (_times(cols["ts"]), _times(cols["dur"])) for name, cols in tables.items()}
    checker = TimeChecker.for_timestamps([ts for ts, _ in times.values()])
    kept: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for name, (ts, dur) in times.items():
        keep, dur = checker.check(ts, dur)
        kept[name] = (keep, ts[keep], dur[keep])
    total = sum(len(ts) for ts, _ in times.values())
    if total and checker.dropped == total:
        raise TraceFormatError(f"{path}: all {total} timed events have impossible timestamps or durations "
                               "(negative, non-finite, or spread over more than a day)")
    base_ns, clock = clock_anchor(meta, [kept[n][1] for n in ("kernels", "launches", "ops", "steps", "modules")])
    # Arrow's allocator keeps what a column's chunks freed for reuse, and the next column rarely fits it: on
    # a large trace that cache is hundreds of MB at the peak, so it is handed back column by column. (On a
    # small one handing it back costs more time, in page faults, than it saves memory.)
    large = total >= LARGE_ROWS

    records = RecordSet(source=str(path), clock=clock)
    try:
        for name, cols in tables.items():
            keep, ts, dur = kept[name]
            if not len(ts):
                continue
            start = _to_ns(ts, base_ns)
            out: dict[str, Any] = {"start_ns": start, "end_ns": start + np.rint(dur * 1000.0).astype(np.int64)}
            every = keep.all()
            for column, values in cols.items():
                if column in ("ts", "dur"):
                    continue
                values = columns.column(name, column, values)
                if isinstance(values, array):
                    values = np.frombuffer(values, dtype=np.int64)
                if column == "kineto_flops":
                    values = pa.array(values, pa.float64())
                elif column in ("model_flops", "model_bytes"):
                    values = _nonnegative_or_null(values, checker)
                elif column in ("grid", "block") and not isinstance(values, pa.Array):
                    values = _dims3_column(values)
                elif column in _COMM_MINIMUM:
                    values = _integers_or_null(values, _COMM_MINIMUM[column], checker)
                elif column in _COMM_COLUMNS:
                    values = _text_or_null(values, checker)
                out[column] = values if every else _take(values, keep)
                if large:
                    release_arrow_cache()
            if name == "modules":
                out["phase"] = ["forward"] * len(ts)
            setattr(records, name, table_from_columns(name, out))
            del out
            cols.clear()  # this table's lists go now, before the next table is built
            if large:
                release_arrow_cache()
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as err:
        raise TraceFormatError(f"{path}: unexpected field types ({str(err).splitlines()[0][:160]})") from None

    records.steps = _without_repeated_steps(records.steps, checker)
    records.devices = devices_of(meta)
    records.resource = resource_of(meta, pids)
    records.counters.update(checker.counters())
    return records


def _without_repeated_steps(steps: pa.Table, checker: TimeChecker) -> pa.Table:
    """A ProfilerStep event written twice (a concatenated or re-exported trace) is one step: as two, its rank
    was counted twice under one span id, doubling the node's GPUs and cost. Dropped, and counted."""
    if steps.num_rows < 2:
        return steps
    key = np.stack([steps.column(c).to_numpy(zero_copy_only=False).astype(np.int64)
                    for c in ("step", "start_ns", "end_ns")], axis=1)
    _, first = np.unique(key, axis=0, return_index=True)
    if len(first) == steps.num_rows:
        return steps
    checker.dropped += steps.num_rows - len(first)
    return steps.take(pa.array(np.sort(first)))


def _nonnegative_or_null(values: list[Any], checker: TimeChecker) -> pa.Array:
    """Per-kernel work numbers (Inductor's kernel_flop, kernel_num_gb): a negative one is unknown, not
    negative work, so it becomes null and is counted."""
    x = np.asarray(values, dtype=np.float64)  # None -> NaN
    with np.errstate(invalid="ignore"):
        bad = ~np.isnan(x) & ~(x >= 0)
    checker.invalid += int(bad.sum())
    return pa.array(x, pa.float64(), mask=np.isnan(x) | bad)


def _integers_or_null(values: list[Any], minimum: int, checker: TimeChecker) -> pa.Array:
    """Message sizes and group sizes: an int of at least ``minimum``. Anything else a source wrote (a
    negative count, 2.5 elements, a string, a bool) is unknown: null, and counted."""
    try:
        arr = pa.array(values, from_pandas=False)  # inferred: int64 when every value is an int or None
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
        arr = None
    if arr is None or not (pa.types.is_int64(arr.type) or pa.types.is_null(arr.type)):
        arr = pa.array([_int_at_least(v, minimum) for v in values], pa.int64())
        checker.invalid += sum(v is not None for v in values) - (len(arr) - arr.null_count)
        return arr
    arr = arr.cast(pa.int64())
    low = pc.less(arr, minimum).fill_null(False)
    bad = int(pc.sum(low).as_py() or 0)
    if bad:
        checker.invalid += bad
        arr = pc.if_else(low, pa.scalar(None, pa.int64()), arr)
    return arr


def _int_at_least(value: Any, minimum: int) -> int | None:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if value.__class__ is int and minimum <= value <= INT64_MAX:
        return value
    return None


def _text_or_null(values: list[Any], checker: TimeChecker) -> pa.Array:
    """Names from the comm metadata: strings (an int process-group name reads as its digits); others null, counted."""
    try:
        return pa.array(values, pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        pass
    out = [v if isinstance(v, str) else str(v) if v.__class__ is int else None for v in values]
    checker.invalid += sum(v is not None and o is None for v, o in zip(values, out))
    return pa.array(out, pa.string())


def _take(values: Any, keep: np.ndarray) -> Any:
    if isinstance(values, np.ndarray):
        return values[keep]
    if isinstance(values, pa.Array):
        return values.filter(pa.array(keep))
    return [v for v, k in zip(values, keep) if k]
