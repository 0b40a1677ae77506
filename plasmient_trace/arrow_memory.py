"""The Arrow memory pool of the offline commands (ingest, replay, report, rank workers): the C library's
allocator, unless the user chose one.

An ingest allocates and frees many short-lived column buffers, and numpy's arrays come from the C heap.
On the system pool both share that heap: what Arrow frees, numpy reuses, and ``memory.trim_heap`` hands
back what neither needs. pyarrow's default pool on Linux, mimalloc, keeps the pages of freed buffers
mapped; jemalloc, this module's choice before, kept about 150 MiB resident after reading a 175k-kernel
trace even once every buffer was freed and ``release_unused`` had run, pages numpy could not use. Measured
with ``benchmarks/bench_ingest.py`` and ``bench_ingest_file.py`` (both honour ``ARROW_DEFAULT_MEMORY_POOL``):
`plasmient ingest` of a 10^6-kernel file peaked at 1,701-1,702 MiB on the system pool against
1,835-1,880 MiB on jemalloc, in the same time; the largest shared traces grew 2.0x, 2.0x and 1.3x their
JSON against 2.1x, 2.2x and 1.3x.

Live capture never calls this: a training job's allocator is the job's own business. ``ARROW_DEFAULT_MEMORY_POOL``,
when set, is the user's choice and stands.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import pyarrow as pa

ENV = "ARROW_DEFAULT_MEMORY_POOL"


def use_offline_pool(environ: Mapping[str, str] = os.environ) -> str:
    """Make the system allocator this process's default Arrow pool (unless ``ARROW_DEFAULT_MEMORY_POOL`` is
    set); returns the backend now in use."""
    if not environ.get(ENV):
        pa.set_memory_pool(pa.system_memory_pool())
    return pa.default_memory_pool().backend_name
