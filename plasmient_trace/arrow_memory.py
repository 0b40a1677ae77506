"""The Arrow memory pool of the offline commands (ingest, replay, report, rank workers): jemalloc, unless the user chose one.

pyarrow's default pool on Linux is mimalloc, which keeps the pages of freed buffers mapped for reuse. An
ingest allocates and frees many short-lived column buffers, so those pages pile up in the process's peak
RSS. With jemalloc, the peak RSS growth of read + stitch + JSONL on the four largest shared traces fell from
1.1-5.5x to 0.8-4.2x of the JSON, at the same speed (``benchmarks/bench_ingest.py``, run once with
``ARROW_DEFAULT_MEMORY_POOL=mimalloc`` and once without); a 10^6-kernel stitch peaked 2-3% lower.

Live capture never calls this: a training job's allocator is the job's own business. ``ARROW_DEFAULT_MEMORY_POOL``,
when set, is the user's choice and stands.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import pyarrow as pa

ENV = "ARROW_DEFAULT_MEMORY_POOL"


def use_offline_pool(environ: Mapping[str, str] = os.environ) -> str:
    """Make jemalloc this process's default Arrow pool (unless ``ARROW_DEFAULT_MEMORY_POOL`` is set, or
    this pyarrow was built without it); returns the backend now in use."""
    if not environ.get(ENV):
        try:
            pa.set_memory_pool(pa.jemalloc_memory_pool())
        except NotImplementedError:  # pyarrow built without jemalloc (macOS wheels): keep the default
            pass
    return pa.default_memory_pool().backend_name
