"""The native span assembler (``json_assemble.c``): built once with the system C compiler, loaded
with ctypes, called by the OTLP/JSON encoder to lay out span objects from their prepared texts.

Why: laying the texts out with numpy index arrays and an Arrow ``take`` costs a dozen array passes
per attribute value; the C loop copies each text once, which cut the instructions of the whole JSON
export by about 40% (1.5-1.6x the spans encoded per CPU second on the replicated v100 trace). It is an accelerator only: where there is no C compiler, the cache is not writable, or
``PLASMIENT_NATIVE_JSON=0``, :func:`assembler` returns None and the numpy layout runs, writing the same
bytes (tests compare the two on the shared traces). Plain C, no Python headers: any ``cc`` builds it.

    python -m plasmient_trace.export.json_native     # build now (e.g. in a container image), print where
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from ..native_build import cache_dir, compile_cached, find_compiler

__all__ = ["PER_ROW", "CONSTANT", "INDEXED", "Texts", "assemble_parts", "assembler", "failure"]

# How a fixed piece's element is chosen for row r (json_assemble.c's fixed_mode): r, 0, or index[r].
PER_ROW, CONSTANT, INDEXED = 0, 1, 2

SOURCE = Path(__file__).with_name("json_assemble.c")
BUILD_TIMEOUT_S = 120
_FLAGS = ["-O2", "-shared", "-fPIC", "-w"]

_lock = threading.Lock()
_function: Callable[..., int] | None = None
_failure: str | None = None


def _compiler() -> str | None:
    return find_compiler("CC", ("cc", "gcc", "clang"))


def artifact_path() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + f"|{' '.join(_FLAGS)}|{platform.machine()}".encode())
    return cache_dir() / key.hexdigest()[:16] / "libplasmient_json_assemble.so"


def assembler() -> Callable[..., int] | None:
    """The C function, built and loaded on first use; None (reason in :func:`failure`) where it cannot
    be, or where ``PLASMIENT_NATIVE_JSON=0``. Never raises."""
    global _function, _failure
    if os.environ.get("PLASMIENT_NATIVE_JSON", "").strip() == "0":
        return None
    if _function is not None or _failure is not None:
        return _function
    with _lock:
        if _function is None and _failure is None:
            try:
                cc = _compiler()
                if cc is None:
                    raise RuntimeError("no C compiler (set CC, or install gcc)")
                path = compile_cached(artifact_path(), [cc, *_FLAGS, str(SOURCE)], "JSON span assembler", BUILD_TIMEOUT_S)
                fn = ctypes.CDLL(str(path)).plasmient_json_assemble
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int32] + [ctypes.c_void_p] * 3 + \
                    [ctypes.c_int32] + [ctypes.c_void_p] * 8 + [ctypes.c_int64, ctypes.c_void_p]
                _function = fn
            except Exception as err:  # a compiler, cache or loader problem: the numpy layout stays
                _failure = f"{type(err).__name__}: {err}"
    return _function


def failure() -> str | None:
    return _failure


class Texts:
    """Binary sources for the assembler: each a (offsets, data) pair of addresses, with the Arrow
    buffers or numpy arrays behind them kept alive while the texts are."""

    def __init__(self) -> None:
        self._keep: list[object] = []

    def of_array(self, arr: pa.Array) -> tuple[int, int]:
        """A large_binary/large_string array without nulls (any offset), zero-copy."""
        offsets, data = arr.buffers()[1], arr.buffers()[2]
        self._keep.append(arr)
        return offsets.address + 8 * arr.offset, data.address if data is not None else self.of_bytes([b""])[1]

    def of_bytes(self, values: Sequence[bytes]) -> tuple[int, int]:
        offsets = np.zeros(len(values) + 1, np.int64)
        np.cumsum([len(v) for v in values], out=offsets[1:])
        data = np.frombuffer(b"".join(values) or b"\0", np.uint8)
        self._keep += [offsets, data]
        return offsets.ctypes.data, data.ctypes.data

    def keep(self, array: np.ndarray) -> int:
        self._keep.append(array)
        return array.ctypes.data


def _pointers(values: Sequence[int]) -> np.ndarray:
    return np.array(list(values), np.uintp)


def assemble_parts(fn: Callable[..., int], n: int, fixed: list[tuple[int, tuple[int, int], np.ndarray | None]],
                   attrs: list[tuple[np.ndarray | None, int, tuple[int, int], int, tuple[int, int]]], closing: tuple[int, int],
                   texts: Texts, part_bytes: int) -> Iterator[pa.Array]:
    """Lay out rows 0..n-1 a part of about ``part_bytes`` at a time; yields large_binary arrays, one
    value per row, each part made when asked for. ``fixed``: (mode, source, index) per fixed piece;
    ``attrs``: (validity per row or None for every row, number of values, values source, closing class,
    prefixes source) per attribute column; ``closing``: the row closings source."""
    mode = np.array([m for m, _, _ in fixed], np.int8)
    fixed_bins = _pointers([p for _, src, _ in fixed for p in src])
    fixed_index = _pointers([texts.keep(np.ascontiguousarray(i, np.int64)) if i is not None else 0 for _, _, i in fixed])
    attr_valid = _pointers([texts.keep(np.ascontiguousarray(v).view(np.uint8)) if v is not None else 0 for v, *_ in attrs] or [0])
    attr_count = np.array([count for _, count, *_ in attrs] or [0], np.int64)
    cursor = np.zeros(max(len(attrs), 1), np.int64)
    values = _pointers([p for _, _, src, _, _ in attrs for p in src] or [0, 0])
    classes = np.array([c for _, _, _, c, _ in attrs] or [0], np.int32)
    prefixes = _pointers([p for *_, src in attrs for p in src] or [0, 0])
    closing_bin = _pointers(closing)
    r, cap = 0, max(int(part_bytes), 1)
    while r < n:
        out = np.empty(cap, np.uint8)
        ends = np.zeros(n - r + 1, np.int64)
        done = fn(r, n, len(fixed), mode.ctypes.data, fixed_bins.ctypes.data, fixed_index.ctypes.data,
                  len(attrs), attr_valid.ctypes.data, attr_count.ctypes.data, cursor.ctypes.data,
                  values.ctypes.data, classes.ctypes.data, prefixes.ctypes.data, closing_bin.ctypes.data,
                  out.ctypes.data, cap, ends[1:].ctypes.data)
        if done == 0:
            cap *= 2  # one row larger than a part: it goes out alone, in a buffer that holds it
            continue
        used = int(ends[done])
        r += done
        yield pa.Array.from_buffers(pa.large_binary(), done, [None, pa.py_buffer(ends[: done + 1].copy()), pa.py_buffer(out[:used])])


def main() -> int:
    if assembler() is None:
        print(f"plasmient-trace: native JSON assembler unavailable: {failure() or 'PLASMIENT_NATIVE_JSON=0'}", file=sys.stderr)
        return 1
    print(f"plasmient-trace: native JSON assembler ready: {artifact_path()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
