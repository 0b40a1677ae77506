"""Read a trace file's bytes under a size cap, gunzipping in bounded chunks (gzip bombs stop early).

A gzip'd trace is inflated a block at a time (``inflate_blocks``, read by ``event_chunks``); a plain
one, or one that reader cannot cut, is parsed from one contiguous buffer (``inflate_whole``). The caps
bound both: they turn "the machine ran out of memory" (a MemoryError traceback, or a segfault inside a
C parser under a cgroup limit) into a one-line error that says which limit to raise:

- ``PLASMIENT_MAX_TRACE_BYTES`` (default 8 GiB): largest decompressed trace accepted;
- ``PLASMIENT_MAX_GZIP_RATIO`` (default 200): largest expansion of a gzip file once its output
  passes 256 MiB. Real Kineto traces expand 7-30x; gzip's own ceiling is about 1030x, which is what
  a bomb (a file of zeros) reaches.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

DEFAULT_MAX_TRACE_BYTES = 8 << 30
DEFAULT_MAX_GZIP_RATIO = 200.0
# Below this output size the ratio is not checked: small, very repetitive traces compress well.
_RATIO_FLOOR_BYTES = 256 << 20
# Small enough that freeing it does not raise glibc's mmap threshold and leave heap pages behind.
_MEASURE_CHUNK = 1 << 20
_INPUT_PIECE = 1 << 20  # compressed bytes fed to zlib per call
# A member's first piece: zlib copies what follows a member's end out of the piece it was fed (unused_data),
# so a file of thousands of tiny (empty) members fed a megabyte at a time copied a megabyte per member.
_FIRST_PIECE = 1 << 12


class InputError(ValueError):
    """The input cannot be read as a trace; str(err) is one line naming the file."""


def _env_number(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise InputError(f"{name}={text!r}: not a number") from None
    if not value > 0:
        raise InputError(f"{name}={text!r}: must be positive")
    return value


def limits() -> tuple[int, float]:
    """(max decompressed bytes, max gzip expansion ratio) from the environment."""
    return (int(_env_number("PLASMIENT_MAX_TRACE_BYTES", DEFAULT_MAX_TRACE_BYTES)),
            _env_number("PLASMIENT_MAX_GZIP_RATIO", DEFAULT_MAX_GZIP_RATIO))


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


def is_gzip(data: bytes) -> bool:
    return data[:2] == b"\x1f\x8b"


def repeated_input(paths: list[Path]) -> str | None:
    """"<b>: the same trace as <a>" when two of the inputs are one trace: one path twice (overlapping shell
    globs), a link to another input, or a byte-for-byte copy. Stitched, they would be two ranks of one job,
    every number counted twice. Copies are told apart by size, then by their first MiB, and read whole
    only when those agree."""
    first_of: dict[tuple[int, int], Path] = {}
    by_size: dict[int, list[Path]] = {}
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            continue  # reading it says what is wrong
        same = first_of.setdefault((st.st_dev, st.st_ino), path)
        if same is not path:
            return f"{path}: the same trace as {same} (one file given twice)"
        if stat.S_ISREG(st.st_mode):
            by_size.setdefault(st.st_size, []).append(path)
    for group in by_size.values():
        by_head: dict[bytes, list[Path]] = {}
        for path in group if len(group) > 1 else ():
            by_head.setdefault(_digest(path, whole=False), []).append(path)
        for candidates in by_head.values():
            whole: dict[bytes, Path] = {}
            for path in candidates if len(candidates) > 1 else ():
                same = whole.setdefault(_digest(path, whole=True), path)
                if same is not path:
                    return f"{path}: the same trace as {same} (a byte-for-byte copy)"
    return None


def _digest(path: Path, whole: bool) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    try:
        with open(path, "rb") as f:
            if not whole:
                h.update(f.read(_MEASURE_CHUNK))
            else:
                for block in iter(lambda: f.read(_MEASURE_CHUNK), b""):
                    h.update(block)
    except OSError:
        h.update(str(path).encode())  # unreadable: reading it says what is wrong
    return h.digest()


TRACE_SUFFIXES = (".json", ".json.gz")


def _natural_key(name: str) -> list[object]:
    """rank-2 before rank-10: the digit runs compared as numbers."""
    parts = re.split(r"(\d+)", name)
    return [int(p) if p.isdigit() else p for p in parts]


def traces_in(paths: list[str]) -> list[str]:
    """The inputs with each directory replaced by the traces directly in it (``*.json`` and ``*.json.gz``, as
    torch.profiler's ``tensorboard_trace_handler`` writes one per rank), in natural order, so a job of a
    thousand ranks is one argument. A directory with none is an InputError naming it."""
    return files_in(paths, TRACE_SUFFIXES, "trace")


def files_in(paths: list[str], suffixes: tuple[str, ...], kind: str) -> list[str]:
    """The inputs with each directory replaced by its files ending in one of ``suffixes``, in natural order;
    a directory with none is an InputError naming it and what was looked for."""
    out: list[str] = []
    for text in paths:
        path = Path(text)
        if not path.is_dir():
            out.append(text)
            continue
        # not is_file(): a dangling link named like an input is one whose file is missing, and reading it
        # says so, where skipping it would stitch (or report) a fleet without that rank
        found = sorted((f.name for f in path.iterdir() if f.name.endswith(suffixes) and not f.is_dir()),
                       key=_natural_key)
        if not found:
            raise InputError(f"{text}: a directory with no {kind} in it (no file ending in {' or '.join(suffixes)})")
        out.extend(str(path / name) for name in found)
    return out


def read_file_bytes(path: Path) -> bytes:
    """The file's own bytes (gzip'd or not), under PLASMIENT_MAX_TRACE_BYTES; one-line errors."""
    max_bytes, _ = limits()
    try:
        with open(path, "rb") as f:
            return _read_capped(path, f, max_bytes)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, expected a trace file") from None
    except MemoryError:
        raise InputError(f"{path}: not enough memory to read the file") from None
    except OSError as err:
        raise InputError(f"{path}: cannot read ({err.strerror or err})") from None


def inflate_whole(path: Path, data: bytes) -> bytes:
    """The whole decompressed document of a file's bytes (the bytes themselves when not gzip'd).

    Always ``bytes``: the decoder's per-event ``msgspec.Raw`` views then point into it without copying."""
    if not is_gzip(data):
        return data
    max_bytes, max_ratio = limits()
    return _gunzip(path, data, max_bytes, max_ratio)


def check_inflated(path: object, inflated: int, packed: int | None, max_bytes: int, max_ratio: float) -> None:
    """InputError once ``inflated`` bytes read so far pass the size cap, or, for gzip'd input (``packed``: the
    compressed bytes they came from), the expansion cap: a trace's gunzip and a span file's reader both stop
    a gzip bomb, /dev/zero or an endless pipe here, with the same line."""
    if inflated > max_bytes:
        raise InputError(f"{path}: {'decompresses to ' if packed is not None else ''}over {_mb(max_bytes)}, the size "
                         "limit (raise PLASMIENT_MAX_TRACE_BYTES to accept it)")
    if packed is not None and inflated > max(_RATIO_FLOOR_BYTES, int(packed * max_ratio)):
        raise InputError(f"{path}: expands more than {max_ratio:g}x ({_mb(packed)} gzip -> over {_mb(inflated)}): "
                         "a gzip bomb? (raise PLASMIENT_MAX_GZIP_RATIO to accept it)")


def _too_big(path: Path, size: str, max_bytes: int) -> InputError:
    return InputError(f"{path}: file is {size}, over the {_mb(max_bytes)} limit "
                      "(raise PLASMIENT_MAX_TRACE_BYTES to accept it)")


def _read_capped(path: Path, f: BinaryIO, max_bytes: int) -> bytes:
    """The file's bytes, never more than the cap: a regular file is sized first; a pipe, a FIFO or a
    device (/dev/zero, process substitution) has no size and is read in chunks up to the cap."""
    if stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise _too_big(path, _mb(size), max_bytes)
        return f.read()
    chunks, total = [], 0
    while chunk := f.read(min(_MEASURE_CHUNK * 16, max_bytes + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > max_bytes:
            raise _too_big(path, f"over {_mb(max_bytes)}", max_bytes)
    return b"".join(chunks)


def _gunzip(path: Path, data: bytes, max_bytes: int, max_ratio: float) -> bytes:
    """Inflate twice: a first pass that keeps nothing measures every member under the caps, then each
    member is inflated in one call into a buffer of exactly its size. Peak memory is the output once;
    collecting chunks and joining them (or growing a bytearray) peaks at twice the output."""
    members = _measure(path, data, max_bytes, max_ratio)
    try:
        parts = [zlib.decompress(data[begin:end], 16 + zlib.MAX_WBITS, max(size, 1)) for begin, end, size in members]
    except MemoryError:
        raise InputError(f"{path}: not enough memory to decompress ({_mb(sum(m[2] for m in members))})") from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _measure(path: Path, data: bytes, max_bytes: int, max_ratio: float) -> list[tuple[int, int, int]]:
    """(start, end, inflated size) of each gzip member (concatenated .gz files are legal), caps enforced."""
    members: list[tuple[int, int, int]] = []
    for _ in inflate_blocks(path, data, _MEASURE_CHUNK, members):
        pass
    return members


def inflate_blocks(path: Path, data: bytes, block_bytes: int,
                   members: list[tuple[int, int, int]] | None = None) -> Iterator[bytes]:
    """The inflated bytes of every gzip member in blocks of at most ``block_bytes``, under the caps;
    ``members`` gets (start, end, inflated size) of each member as it ends.

    The compressed input is fed a piece at a time: zlib copies what a call leaves unconsumed, so
    feeding it all at once would copy the rest of the file at every block."""
    max_bytes, max_ratio = limits()
    view = memoryview(data)
    total = 0
    begin = 0
    try:
        while True:
            inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            at, size, feed = begin, 0, _FIRST_PIECE
            piece: bytes | memoryview = b""
            while not inflater.eof:
                if not piece and at < len(data):
                    piece = view[at:at + feed]
                    at += len(piece)
                    feed = min(feed * 2, _INPUT_PIECE)
                block = inflater.decompress(piece, block_bytes)
                piece = inflater.unconsumed_tail
                if not block and not piece and at >= len(data) and not inflater.eof:
                    raise InputError(f"{path}: truncated gzip stream (the file was cut short)")
                size += len(block)
                check_inflated(path, total + size, len(data), max_bytes, max_ratio)
                if block:
                    yield block
            end = at - len(inflater.unused_data)
            if members is not None:
                members.append((begin, end, size))
            total += size
            # Another member follows, or only zero padding does; looking at the whole rest of the file after
            # every member (as this once did) is quadratic in a file of many small members.
            if data[end:end + 2] != b"\x1f\x8b" and not data[end:].strip(b"\x00"):
                return
            begin = end
    except zlib.error as err:
        raise InputError(f"{path}: corrupt gzip data ({err})") from None
