"""Memory behaviour of large parses: the cyclic GC paused while they build objects, and freed memory handed
back to the OS between the phases of a large ingest (parse, FLOP models, join, stitch).

glibc keeps what millions of short-lived objects and arrays freed (fragmented, about 140 MB after a
10^6-kernel parse). The offline commands give Arrow the same heap (``arrow_memory``); a pool the user
chose keeps its own free pages for reuse, which numpy, on the C heap, cannot use. Handing pages back costs
page faults later: only large inputs do it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import pyarrow as pa

# Inputs with at least this many rows (events, ops) hand freed memory back between phases; below it the
# page faults that follow cost more time than the memory is worth.
LARGE_ROWS = 1_000_000


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """The cyclic GC off for a parse that builds millions of acyclic objects and keeps many of them: each
    collection would rescan every one still alive and find no cycle (3/4 of ``orjson.loads``'s time on a
    line of 5,000 spans, 30-40% of a Kineto parse). Refcounting still frees them. Restored as it was."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def trim_heap() -> None:
    """Give the C heap's free pages back (glibc only; elsewhere nothing to do)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


def release_arrow_cache() -> None:
    """Give back the free pages Arrow's allocator keeps for reuse."""
    pa.default_memory_pool().release_unused()


def return_freed_memory() -> None:
    """Both: between phases, where what comes next allocates from either."""
    trim_heap()
    release_arrow_cache()
