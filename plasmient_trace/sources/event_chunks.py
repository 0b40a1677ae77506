"""A gzip'd Chrome trace's events in chunks of whole events, inflated as they are read.

The decompressed document never exists at once: a 10^6-kernel trace is about 4 GB of JSON, and its
record tables about a fifth of that. Blocks are inflated under the same caps as ``rawinput`` and cut into
chunks of whole events, each decoded into typed :class:`KinetoEvent` structs by one call (a third faster
than views of each event decoded one by one: the chunk is parsed once, not scanned and then parsed).

Where to cut is found by the decoder itself. A chunk starts at a boundary between two events; a
candidate end (a ``}`` followed by ``,``, latest first) is right exactly when ``[`` + chunk + ``]``
decodes, since a parser that starts at a boundary can only reach the end of the text between two
events. A wrong cut fails as a syntax error; a type error is a real event's (a parser that starts at a
boundary reads real fields until it fails), and is reported as :class:`MalformedEvent`, named by its
index as the whole-document reader names it. The document around the events (``deviceProperties``,
``baseTimeNanoseconds``, ...) is decoded once the array is closed, as the document with an empty
``traceEvents``.

Anything this reader does not expect (no ``traceEvents`` near the top, an event larger than the
buffer allows, a closing it cannot place, a corrupt or capped stream) raises :class:`Unstreamable`,
and the caller reads the file whole, which names the problem exactly as before.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from .kineto_schema import KinetoDocument, KinetoEvent, MalformedEvent, malformed_event
from .rawinput import InputError, inflate_blocks

# Inflated per step; a chunk of events is about this size. Decoded into typed events (some 2.5x the
# chunk's bytes while they live), 512 KiB chunks read the four largest shared traces 10-20% faster than
# 2 MiB ones, with a read peak of 10-26 MiB instead of 24-33 (bench_ingest.py --skip-scale).
BLOCK_BYTES = 1 << 19
_MAX_BUFFER = 256 << 20    # one event larger than this: read the file whole
_MAX_HEAD = 16 << 20       # no traceEvents array opened in this many bytes: read the file whole
_CUT_TRIES = 16            # candidate cuts tried per chunk before reading more
_KEY = b'"traceEvents"'
_CLOSING = re.compile(rb"\}[ \t\r\n]*\]")
_NOT_WHITESPACE = re.compile(rb"[^ \t\r\n]")
_EVENTS = msgspec.json.Decoder(list[KinetoEvent])
_DOCUMENT = msgspec.json.Decoder(KinetoDocument)


class Unstreamable(Exception):
    """This file is read whole instead (the whole-document reader reports any problem)."""


def _malformed(err: msgspec.ValidationError, first: int) -> MalformedEvent | Unstreamable:
    """The type error of a chunk's event as :class:`MalformedEvent` (its index counted from ``first``, the
    chunk's first event), or :class:`Unstreamable` where msgspec's path names no event."""
    return malformed_event(err, first, in_list=True) or Unstreamable("a malformed event")


class EventChunks:
    """Iterate to get each chunk's events (``list[KinetoEvent]``); ``meta`` is set once they are exhausted.
    When the whole document inflates to one block, ``whole`` holds it and nothing is to be iterated."""

    def __init__(self, data: bytes, path: Path | str = "trace") -> None:
        self._blocks = _inflate(Path(path), data)
        first = next(self._blocks, b"")
        second = next(self._blocks, None)
        # A document that fits in one block is decoded whole, as an uncompressed file is: cutting it
        # would only add copies.
        self.whole: bytes | None = first if second is None else None
        self._read = [first] if second is None else [first, second]
        self.meta: dict[str, Any] | None = None
        self._count = 0  # events handed out so far: a malformed one is named by its index in the document

    def __iter__(self) -> Iterator[list[KinetoEvent]]:
        blocks = self._blocks_in_order()
        # The head: up to the '[' that opens traceEvents. Each block is searched once (with the few bytes
        # before it that could start the key): a file with no such key must not be rescanned and recopied
        # at every block.
        pieces: list[bytes] = []
        size = 0
        at = -1
        for block in blocks:
            pieces.append(block)
            size += len(block)
            del block
            if at < 0:
                tail = pieces[-2][1 - len(_KEY):] + pieces[-1] if len(pieces) > 1 else pieces[-1]
                found = tail.find(_KEY)
                if found >= 0:
                    at = size - len(tail) + found
            if at >= 0:
                buf = b"".join(pieces)
                pieces = [buf]
                opened = _array_start(buf, at + len(_KEY))
                if opened is not None:
                    break
            if size > _MAX_HEAD:
                raise Unstreamable("no traceEvents near the top")
        else:
            raise Unstreamable("no traceEvents")
        head = buf[:at + len(_KEY)]
        rest = buf[opened:]  # from an event boundary on, not cut yet
        del buf
        # At most about three blocks at once: the one just inflated, the buffer it extends, and the
        # chunk being decoded; between chunks, one chunk and its events. When a buffer holds no
        # boundary (one huge event, or megabytes of whitespace), blocks are gathered until it has
        # doubled before looking again: the searches and copies then add up to a few times its size,
        # not its square.
        pending, pending_bytes, next_look = [rest], len(rest), 0
        del rest
        while True:
            nxt = next(blocks, None)
            exhausted = nxt is None
            if not exhausted:
                pending.append(nxt)
                pending_bytes += len(nxt)
                del nxt
                if pending_bytes < next_look:
                    continue
            buf = b"".join(pending) if len(pending) > 1 else pending[0]
            pending = []
            first = _skip(buf, 0)
            pos = _after_separator(buf, first)
            if exhausted:
                events, self.meta = _close(buf, pos, head, self._count)
                del buf
                if events:
                    yield events
                return
            cut = _cut(buf, pos, self._count)
            if cut is None:  # no boundary yet: an event longer than what is buffered
                if len(buf) > _MAX_BUFFER:
                    raise Unstreamable("an event larger than the buffer")
                if pos:  # the whitespace (and the one ',') before the event is all that can be let go
                    buf = (b"," if buf[first:first + 1] == b"," else b"") + buf[pos:]
                # look again once doubled, and last at the cap, so an event just under it is still cut
                pending, pending_bytes, next_look = [buf], len(buf), min(2 * len(buf), _MAX_BUFFER + 1)
                del buf
                continue
            events, end = cut
            rest = buf[end:]
            del buf
            pending, pending_bytes, next_look = [rest], len(rest), 0
            del rest
            self._count += len(events)
            yield events
            del events

    def _blocks_in_order(self) -> Iterator[bytes]:
        """The blocks read ahead in __init__, then the rest; each let go once handed out."""
        while self._read:
            yield self._read.pop(0)
        yield from self._blocks


def _array_start(buf: bytes, after_key: int) -> int | None:
    """Index just past the '[' of ``"traceEvents": [``, None when the buffer ends before it."""
    i = _skip(buf, after_key)
    if i >= len(buf):
        return None
    if buf[i:i + 1] != b":":
        raise Unstreamable("traceEvents is not a key")
    i = _skip(buf, i + 1)
    if i >= len(buf):
        return None
    if buf[i:i + 1] != b"[":
        raise Unstreamable("traceEvents is not a list")
    return i + 1


def _skip(buf: bytes, i: int) -> int:
    """The first index at or after ``i`` that is not JSON whitespace (``len(buf)`` when none is)."""
    found = _NOT_WHITESPACE.search(buf, i)
    return len(buf) if found is None else found.start()


def _after_separator(buf: bytes, pos: int) -> int:
    """Where the next event starts: past whitespace and the ',' between two events."""
    i = _skip(buf, pos)
    if buf[i:i + 1] == b",":
        i = _skip(buf, i + 1)
    return i


def _cut(buf: bytes, pos: int, first: int) -> tuple[list[KinetoEvent], int] | None:
    """The whole events in buf[pos:] up to a boundary near its end, and where the rest starts; None when
    no boundary is found. ``first``: the index of the first of them in the document."""
    end = len(buf)
    view = memoryview(buf)
    for _ in range(_CUT_TRIES):
        brace = buf.rfind(b"}", pos, end)
        if brace < 0:
            return None
        after = _skip(buf, brace + 1)
        if buf[after:after + 1] == b",":
            events = _decode_events(b"[" + view[pos:brace + 1] + b"]", first)
            if events is not None:
                return events, brace + 1
        end = brace
    return None


def _decode_events(text: bytes, first: int) -> list[KinetoEvent] | None:
    """``text`` (``[`` + a candidate chunk + ``]``) as typed events; None when it is not JSON (a wrong cut)."""
    try:
        return _EVENTS.decode(text)
    except msgspec.ValidationError as err:
        raise _malformed(err, first) from None
    except msgspec.DecodeError:
        return None
    except (RecursionError, MemoryError):
        raise Unstreamable("nested too deeply, or too large") from None


def _close(buf: bytes, pos: int, head: bytes, first: int) -> tuple[list[KinetoEvent], dict[str, Any]]:
    """At the end of the input: the last events, and the document around them (as ``_decode``'s meta).
    ``first``: the index of the first of them in the document."""
    view = memoryview(buf)
    # The array closes at a ']' right after an event's '}' (or at once, when it is empty). Forward, because
    # what follows it (Kineto's "traceLog" lines) may hold many ']'.
    ends = itertools.chain([pos] if buf[pos:pos + 1] == b"]" else [], (m.end() - 1 for m in _CLOSING.finditer(buf, pos)))
    for bracket in itertools.islice(ends, _CUT_TRIES):
        events = _decode_events(b"[" + view[pos:bracket] + b"]", first)
        if events is None:
            continue
        try:
            doc = _DOCUMENT.decode(head + b":[]" + view[bracket + 1:])
        except msgspec.ValidationError:
            raise Unstreamable("a malformed document") from None
        except msgspec.DecodeError:
            continue
        except (RecursionError, MemoryError):
            raise Unstreamable("nested too deeply, or too large") from None
        if doc.traceEvents:  # the key found first was not the top-level one
            raise Unstreamable("traceEvents twice")
        return events, {"deviceProperties": doc.deviceProperties, "baseTimeNanoseconds": doc.baseTimeNanoseconds,
                        "distributedInfo": doc.distributedInfo}
    raise Unstreamable("cannot place the end of traceEvents")


def _inflate(path: Path, data: bytes) -> Iterator[bytes]:
    """``rawinput.inflate_blocks``, its problems left to the whole-document reader to report."""
    try:
        yield from inflate_blocks(path, data, BLOCK_BYTES)
    except InputError as err:
        raise Unstreamable(str(err)) from None
