"""Vectorised byte building shared by the OTLP encoders: hex ids, varints, number texts, and
:class:`Pieces`, which lays out per-row sequences of byte pieces with one Arrow ``take``.

Nothing here knows about spans: the inputs are numpy arrays and Arrow arrays, the outputs Arrow
``large_binary`` arrays with one value per row.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

__all__ = [
    "LB",
    "Pieces",
    "Varint",
    "build_rows",
    "hex_matrix",
    "join",
    "needs_json_escape",
    "number_texts",
    "string_data",
    "u64_be_matrix",
    "u64_le_matrix",
    "varint_array",
    "varint_lengths",
]

LB = pa.large_binary()  # int64 offsets: a chunk's fragments never hit the 2 GiB binary limit
_EMPTY = pa.scalar(b"", LB)
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


def join(parts: list[pa.Array | pa.Scalar], null_handling: str = "emit_null") -> pa.Array:
    """Row-wise concatenation of large_binary arrays/scalars (Arrow's binary_join_element_wise).

    Never use 'skip' where every part of a row can be null: pyarrow 26 then *drops the row*,
    returning a shorter array.
    """
    return pc.binary_join_element_wise(*parts, _EMPTY, null_handling=null_handling)


def hex_matrix(raw: np.ndarray) -> np.ndarray:
    """(n, k) bytes -> (n, 2k) lowercase hex ASCII."""
    out = np.empty((raw.shape[0], raw.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = _HEX[raw >> 4]
    out[:, 1::2] = _HEX[raw & 0x0F]
    return out


def u64_be_matrix(values: np.ndarray) -> np.ndarray:
    """uint64 -> (n, 8) big-endian bytes: the 8-byte OTLP span id whose hex equals f'{v:016x}'."""
    return np.ascontiguousarray(values.astype(">u8")).view(np.uint8).reshape(-1, 8)


def u64_le_matrix(values: np.ndarray) -> np.ndarray:
    """int64/uint64/float64 -> (n, 8) little-endian bytes (protobuf fixed64 / double)."""
    dtype = "<f8" if values.dtype.kind == "f" else "<u8"
    return np.ascontiguousarray(values.astype(dtype)).view(np.uint8).reshape(-1, 8)


def varint_lengths(values: np.ndarray) -> np.ndarray:
    """Bytes of the protobuf varint of each uint64."""
    v = values.astype(np.uint64, copy=False)
    n = np.ones(v.shape, dtype=np.int64)
    for k in range(1, 10):
        longer = v >= np.uint64(1 << (7 * k))
        if not longer.any():
            break
        n += longer
    return n


class Varint:
    """A build_rows part: the protobuf varint of one uint64 per row."""

    __slots__ = ("lengths", "values")

    def __init__(self, values: np.ndarray) -> None:
        self.values = values.astype(np.uint64, copy=False)
        self.lengths = varint_lengths(self.values)


def _varint_bytes(v: Varint, k: int, sel: np.ndarray | None = None) -> np.ndarray:
    """Byte k of the varints (of the selected ones only, when ``sel`` is given)."""
    values, lengths = (v.values, v.lengths) if sel is None else (v.values[sel], v.lengths[sel])
    byte = ((values >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
    byte[lengths > k + 1] |= 0x80
    return byte


def varint_array(values: np.ndarray | Varint) -> pa.Array:
    """Protobuf varints of uint64 values as a large_binary array (no nulls)."""
    v = values if isinstance(values, Varint) else Varint(values)
    m = len(v.values)
    if m and int(v.lengths.max()) == 1:  # all below 128: the varint is the byte itself
        return pa.Array.from_buffers(LB, m, [None, pa.py_buffer(np.arange(m + 1, dtype=np.int64)), pa.py_buffer(v.values.astype(np.uint8))])
    offsets = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(v.lengths, out=offsets[1:])
    # All bytes of all varints as an (m, longest) matrix, then the real ones picked in row order.
    width = int(v.lengths.max(initial=1))
    k = np.arange(width)
    matrix = ((v.values[:, None] >> (np.uint64(7) * k.astype(np.uint64))) & np.uint64(0x7F)).astype(np.uint8)
    matrix[k[None, :] < v.lengths[:, None] - 1] |= 0x80
    out = np.ascontiguousarray(matrix[k[None, :] < v.lengths[:, None]])
    return pa.Array.from_buffers(LB, m, [None, pa.py_buffer(offsets), pa.py_buffer(out)])


def build_rows(m: int, parts: list[bytes | np.ndarray | Varint]) -> pa.Array:
    """large_binary array whose row i concatenates the parts' row i.

    Parts are constants (bytes), per-row fixed-width bytes ((m, w) uint8) or per-row varints.
    Rows of equal width (the common case: all varints one byte) are filled column-block-wise.
    """
    uniform = all(not isinstance(p, Varint) or m == 0 or p.lengths.min() == p.lengths.max() for p in parts)
    if uniform:
        widths = [len(p) if isinstance(p, bytes) else (int(p.lengths[0]) if m else 1) if isinstance(p, Varint) else p.shape[1] for p in parts]
        width = sum(widths)
        out = np.empty((m, width), dtype=np.uint8)
        pos = 0
        for p, w in zip(parts, widths):
            if isinstance(p, bytes):
                out[:, pos : pos + w] = np.frombuffer(p, dtype=np.uint8)
            elif isinstance(p, Varint):
                for k in range(w):
                    out[:, pos + k] = _varint_bytes(p, k)
            else:
                out[:, pos : pos + w] = p
            pos += w
        offsets = np.arange(m + 1, dtype=np.int64) * width
        return pa.Array.from_buffers(LB, m, [None, pa.py_buffer(offsets), pa.py_buffer(out)])
    lengths = np.zeros(m, dtype=np.int64)
    for p in parts:
        lengths += len(p) if isinstance(p, bytes) else p.lengths if isinstance(p, Varint) else p.shape[1]
    offsets = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    out = np.empty(int(offsets[-1]), dtype=np.uint8)
    pos = offsets[:-1].copy()
    for p in parts:
        if isinstance(p, Varint):
            for k in range(int(p.lengths.max())):
                sel = p.lengths > k
                out[pos[sel] + k] = _varint_bytes(p, k, sel)
            pos += p.lengths
        else:
            block = np.frombuffer(p, dtype=np.uint8)[None, :] if isinstance(p, bytes) else p
            w = block.shape[1]
            if w:
                out[pos[:, None] + np.arange(w)] = block
            pos += w
    return pa.Array.from_buffers(LB, m, [None, pa.py_buffer(offsets), pa.py_buffer(out)])


def number_texts(values: np.ndarray, terminator: bytes) -> pa.Array:
    """Decimal text of each int64/float64, followed by ``terminator`` (one byte), as large_binary.

    orjson prints a numpy array (shortest round-trip doubles) about 5x faster than an Arrow cast;
    each separator it writes becomes the terminator, so the values are sliced out without copying.
    """
    m = len(values)
    if m == 0:
        return pa.array([], LB)
    buf = np.frombuffer(bytearray(orjson.dumps(np.ascontiguousarray(values), option=orjson.OPT_SERIALIZE_NUMPY)), dtype=np.uint8)
    seps = np.flatnonzero(buf == ord(","))
    if len(seps) != m - 1:
        raise AssertionError("number text has unexpected separators")  # numbers never contain ','
    term = terminator[0]
    buf[seps] = term
    buf[-1] = term
    offsets = np.empty(m + 1, dtype=np.int64)
    offsets[0] = 1
    offsets[1:m] = seps + 1
    offsets[m] = len(buf)
    return pa.Array.from_buffers(LB, m, [None, pa.py_buffer(offsets), pa.py_buffer(buf)])


_CONST = np.int64(1 << 48)  # piece ids at or above this name a constant, not a pooled array element


class Pieces:
    """Per-row sequences of byte pieces, concatenated for all rows by Arrow ``take``.

    Pieces are constants or elements of pooled arrays. Rows get their pieces either in runs (each
    ``per_row``/``per_row_major`` call appends one more run to every row) or, when the number of
    pieces of every row is known up front, by position (``layout`` then ``put``). ``build`` gathers
    the pieces row by row and returns one large_binary value per row; ``build_parts`` does the same
    in parts of at most ``rows_per_part`` rows, so the gathered bytes are never more than one part's.
    The work per span is a handful of numpy index operations and one memcpy per piece.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self._arrays: list[pa.Array] = []
        self._size = 0
        self._consts: dict[bytes, int] = {}
        self._const_list: list[bytes] = []
        self._runs: list[tuple[np.ndarray | None, np.ndarray]] = []  # (pieces per row or None for one, ids)
        self._order: np.ndarray | None = None  # piece ids row after row, when laid out up front
        self._row_first: np.ndarray | None = None

    def array(self, arr: pa.Array) -> np.ndarray:
        """Pool ``arr``; returns the piece id of each of its elements."""
        base = self.pool(arr)
        return np.arange(base, base + len(arr), dtype=np.int64)

    def pool(self, arr: pa.Array) -> int:
        """Pool ``arr``; returns the piece id of its first element (the others follow it)."""
        base = self._size
        self._arrays.append(arr if arr.type == LB else arr.cast(LB))
        self._size += len(arr)
        return base

    def const(self, value: bytes) -> np.int64:
        """Piece id of a constant (registered once per distinct value)."""
        i = self._consts.get(value)
        if i is None:
            i = self._consts[value] = len(self._const_list)
            self._const_list.append(value)
        return _CONST + np.int64(i)

    @property
    def pooled_bytes(self) -> int:
        """Bytes of the pooled arrays' values (each is typically used once)."""
        return sum(len(string_data(arr)) for arr in self._arrays)

    def const_value(self, piece_id: int) -> bytes:
        return self._const_list[piece_id - int(_CONST)]

    def per_row(self, ids: np.ndarray | np.int64) -> None:
        """One piece for every row (an id per row, or one constant id for all)."""
        self._runs.append((None, np.broadcast_to(np.asarray(ids, dtype=np.int64), (self.n,))))

    def per_row_major(self, counts: np.ndarray, ids: np.ndarray) -> None:
        """``counts[r]`` pieces for row r, given row after row in ``ids`` (no per-piece row/rank needed)."""
        self._runs.append((counts, ids))

    def layout(self, per_row: np.ndarray) -> np.ndarray:
        """Fix how many pieces each row has; returns the first position of each row (n + 1 values) for ``put``."""
        if self._runs:
            raise AssertionError("Pieces: layout() after per_row()")  # an encoder bug, never input
        self._row_first = np.zeros(self.n + 1, dtype=np.int64)
        np.cumsum(per_row, out=self._row_first[1:])
        self._order = np.empty(int(self._row_first[-1]), dtype=np.int64)
        return self._row_first

    def put(self, positions: np.ndarray, ids: np.ndarray | np.int64) -> None:
        """Place pieces at absolute positions of the layout (every position must be put exactly once)."""
        assert self._order is not None
        self._order[positions] = ids

    def _order_by_runs(self) -> tuple[np.ndarray, np.ndarray]:
        n = self.n
        per_row = np.zeros(n, dtype=np.int64)
        for counts, _ in self._runs:
            per_row += 1 if counts is None else counts
        row_first = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(per_row, out=row_first[1:])
        order = np.empty(int(row_first[-1]), dtype=np.int64)
        at = row_first[:-1].copy()  # next free position of each row
        for counts, ids in self._runs:
            if counts is None:
                order[at] = ids
                at += 1
            else:
                # Row r's pieces go to at[r], at[r] + 1, ...: increasing positions, streaming writes.
                run_first = np.zeros(n, dtype=np.int64)
                np.cumsum(counts[:-1], out=run_first[1:])
                order[np.repeat(at - run_first, counts) + np.arange(len(ids), dtype=np.int64)] = ids
                at += counts
        return order, row_first

    def build(self) -> pa.Array:
        """All rows as one large_binary array."""
        return next(self.build_parts(self.n or 1))

    def build_parts(self, rows_per_part: int) -> Iterator[pa.Array]:
        """The rows as consecutive large_binary arrays of at most ``rows_per_part`` rows each.

        A part's bytes are gathered only when it is asked for: the caller holds one part at a time.
        """
        if self._order is not None and self._row_first is not None:
            order, row_first = self._order, self._row_first
        else:
            order, row_first = self._order_by_runs()
        pool = pa.concat_arrays(self._arrays + [pa.array(self._const_list, LB)])
        # constants follow the pooled arrays in the pool: one pass over the ids, no gather and scatter of them
        np.subtract(order, _CONST - self._size, out=order, where=order >= _CONST)
        n = self.n
        for r0 in range(0, max(n, 1), rows_per_part):
            r1 = min(n, r0 + rows_per_part)
            first = row_first[r0 : r1 + 1]
            taken = pool.take(pa.array(order[first[0] : first[-1]]))
            piece_offsets = np.frombuffer(taken.buffers()[1], dtype=np.int64)[taken.offset : taken.offset + len(taken) + 1]
            row_offsets = np.ascontiguousarray(piece_offsets[first - first[0]])
            yield pa.Array.from_buffers(LB, r1 - r0, [None, pa.py_buffer(row_offsets), taken.buffers()[2]])


def string_data(arr: pa.Array) -> np.ndarray:
    """The UTF-8 bytes of a (large_)string array's values, as one uint8 array."""
    n = len(arr)
    if n == 0 or arr.buffers()[2] is None:
        return np.empty(0, dtype=np.uint8)
    width = np.int64 if pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type) else np.int32
    offs = np.frombuffer(arr.buffers()[1], dtype=width)[arr.offset : arr.offset + n + 1]
    return np.frombuffer(arr.buffers()[2], dtype=np.uint8)[int(offs[0]) : int(offs[-1])]


def needs_json_escape(arr: pa.Array) -> bool:
    """Whether any value has a quote, backslash or control character (usually none do)."""
    data = string_data(arr)
    if not len(data):
        return False
    if data.min() < 0x20:
        return True
    raw = data.tobytes()  # a memcpy; 'in' on bytes is memchr
    return b'"' in raw or b"\\" in raw
