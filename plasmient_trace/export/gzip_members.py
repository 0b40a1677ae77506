"""Reading a gzip'd span file member by member, so a member a full disk cut short costs its own line only.

The live file sink writes a ``.gz`` as one gzip member per line, each in one ``write``. A write a full disk
cut short leaves part of a member, and once the disk has room the next line's member follows it. Read as
one gzip stream (``gzip.GzipFile``), the inflater ran on from the cut into the next member's bytes and
failed there, or ran on to the end of the file without failing (any bits decode as some Huffman code):
the file was refused from that point, every trace after the cut lost with it.

``GzipMembers`` inflates one member at a time and hands a member's output on only once its checksum has
ended it, so nothing of a broken member reaches the lines. A member that breaks is left out (the bytes it
spans are kept in ``cuts`` for the reader to report) and reading goes on at the next gzip header after the
start of that member. A member breaks when its inflater fails, its checksum does not match, or the file
ends inside it while another member's header follows its start. Two limits: a member whose output passes
``HOLD_BYTES`` (an ingest's one stream, not a live line) is handed on as it inflates, so a break inside it
fails the read as before; and a file that ends inside a member (a run still writing it) raises EOFError
after every whole member before it.
"""

from __future__ import annotations

import io
import zlib
from collections import deque
from typing import IO, Any

from plasmient_trace.sources.rawinput import InputError, check_inflated, limits

GZIP_MAGIC = b"\x1f\x8b\x08"  # ID1, ID2, deflate: the start of every member the sinks write
HOLD_BYTES = 64 << 20  # a member's output held back until its checksum, at most this much
_PIECE = 1 << 20  # the most output one inflate call makes: a gzip bomb is checked a piece at a time
_READ = 1 << 16
# Bytes a file may have inflated again after its members broke, as a multiple of its size: finding the next
# header re-reads a broken member's bytes, and a file crafted with headers inside headers would otherwise be
# read once per header it holds.
REREAD_RATIO = 4


class Counted:
    """A file that counts the bytes read from it: the gzip'd bytes behind a pipe, whose size is not known."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f, self.count = f, 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.count += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class GzipMembers(io.RawIOBase):
    """The inflated bytes of a gzip stream of one or more members (see the module docstring). ``cuts``: per
    stretch of bytes left out, [first byte, the byte after it]: from a member that broke (or bytes between
    members that start none) to the next member that ended whole, or to the end of the file."""

    def __init__(self, packed: Counted, name: str) -> None:
        self.packed = packed
        self.name = name
        self.cuts: list[list[int]] = []
        self._limits = limits()
        self._pending = b""  # gzip'd bytes read but not yet inflated
        self._pending_at = 0  # the file offset of _pending's first byte
        self._inflater: Any = None  # the current member's, None between members
        self._member: bytearray | None = None  # the current member's gzip'd bytes, kept while its output is held
        self._member_at = 0
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._ready: deque[memoryview] = deque()  # inflated pieces to hand on, in order
        self._inflated = 0
        self._fed = 0  # gzip'd bytes given to inflaters, re-read ones included
        self._recovering = False  # since a cut, until a member ends whole: later failures are the same cut

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.packed.fileno()

    def readinto(self, buffer: Any) -> int:
        while not self._ready:
            if not self._more():
                return 0
        piece = self._ready[0]
        n = min(len(buffer), len(piece))
        buffer[:n] = piece[:n]
        if n == len(piece):
            self._ready.popleft()
        else:
            self._ready[0] = piece[n:]
        return n

    def _hand_on(self, pieces: list[bytes]) -> bool:
        self._ready.extend(memoryview(p) for p in pieces if p)
        return bool(self._ready)

    def _fill(self) -> bool:
        chunk = self.packed.read(_READ)
        if chunk:
            self._pending += chunk
        return bool(chunk)

    def _cut(self, at: int) -> None:
        if not self._recovering:
            self.cuts.append([at, at])
            self._recovering = True

    def _cut_ends(self, at: int) -> None:
        if self._recovering:
            self.cuts[-1][1] = at
            self._recovering = False

    def _end_member(self) -> None:
        self._inflater = self._member = None
        self._held, self._held_bytes = [], 0

    def _broken(self, rest: bytes, at: int) -> None:
        """The current member broke: it is left out, and the next header is looked for in ``rest``, the bytes
        from file offset ``at`` on (inside the member, so a member its inflater ran into is read again)."""
        self._cut(self._member_at)
        self._pending, self._pending_at = rest, at
        self._end_member()

    def _to_next_header(self) -> bool:
        """Drop bytes up to the next gzip header (a broken member's rest); False at the end of the file.
        Zero bytes after the last whole member and nothing else are padding, as gzip(1) and Python's gzip
        read them (and ``rawinput.inflate_blocks``): no cut."""
        opens = None if self._recovering else len(self.cuts)  # the index a stretch starting here gets
        zeros = True
        while True:
            at = self._pending.find(GZIP_MAGIC)
            if at == 0:
                return True
            if at > 0 or len(self._pending) >= len(GZIP_MAGIC):
                self._cut(self._pending_at)
                drop = at if at > 0 else len(self._pending) - (len(GZIP_MAGIC) - 1)  # a header may straddle reads
                zeros = zeros and not self._pending[:drop].strip(b"\x00")
                self._pending, self._pending_at = self._pending[drop:], self._pending_at + drop
                if at > 0:
                    return True
            if not self._fill():
                if self._pending:
                    self._cut(self._pending_at)
                    zeros = zeros and not self._pending.strip(b"\x00")
                self._cut_ends(self._pending_at + len(self._pending))
                if opens is not None and zeros and len(self.cuts) > opens:
                    del self.cuts[opens:]
                return False

    def _more(self) -> bool:
        """Make inflated bytes ready in ``_ready``; False at the end of the file, after whole members."""
        while True:
            if self._inflater is None:
                if not self._pending and not self._fill():
                    self._cut_ends(self._pending_at)
                    return False
                if not self._to_next_header():
                    return False
                self._inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
                self._member, self._member_at = bytearray(), self._pending_at
            if not self._pending and not self._fill():
                # The file ends inside this member. With another member's header inside it, it is one a full
                # disk cut short: its inflater ran on through the next member's bytes without failing (any
                # bits decode as some Huffman code), so they are read again from that header.
                later = self._member.find(GZIP_MAGIC, 1) if self._member is not None else -1
                if later < 0:
                    self._cut_ends(self._member_at)  # what broke before this member, which is incomplete
                    raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                self._broken(bytes(self._member[later:]), self._member_at + later)
                continue
            data, at = self._pending, self._pending_at
            try:
                out = self._inflater.decompress(data, _PIECE)
            except zlib.error:
                if self._member is None:
                    raise  # its output is already handed on: the read fails, as a single stream's does
                # the next member starts after this one's first byte: look for its header there
                self._broken((bytes(self._member) + data)[1:], self._member_at + 1)
                continue
            rest = self._inflater.unused_data if self._inflater.eof else self._inflater.unconsumed_tail
            used = len(data) - len(rest)
            self._pending, self._pending_at = rest, at + used
            self._fed += used
            if self._fed > REREAD_RATIO * self.packed.count + _READ:
                raise InputError(f"{self.name}: gzip members broken past repair (re-read more than {REREAD_RATIO}x "
                                 "the file looking for whole ones)")
            if self._member is not None:
                self._member += data[:used]
            self._inflated += len(out)
            check_inflated(self.name, self._inflated, self.packed.count, *self._limits)
            if self._inflater.eof:  # the checksum and size matched: the member is whole
                pieces = [*self._held, out]
                self._cut_ends(self._member_at)
                self._end_member()
                if self._hand_on(pieces):
                    return True
                continue
            if self._member is None:
                if self._hand_on([out]):
                    return True
                continue
            self._held.append(out)
            self._held_bytes += len(out)
            if self._held_bytes > HOLD_BYTES:  # an ingest's stream, not a line: handed on as it inflates
                pieces, self._held, self._held_bytes, self._member = self._held, [], 0, None
                self._hand_on(pieces)
                return True
