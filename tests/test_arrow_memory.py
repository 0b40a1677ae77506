"""The offline commands run on the system allocator's Arrow pool (the heap numpy uses too, so less retained
memory); the pool never changes a number, the user's ARROW_DEFAULT_MEMORY_POOL stands, and the traced job's
environment is not touched."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from conftest import trace_path

# `plasmient ingest` in a fresh interpreter, then the pool it ran on
INGEST_THEN_POOL = (
    "import sys, pyarrow as pa\n"
    "from plasmient_trace.cli import main\n"
    "rc = main(['ingest', sys.argv[1], '--out', sys.argv[2], '--job-id', 'pool', '--quiet'])\n"
    "print(pa.default_memory_pool().backend_name, rc)\n"
)


def _ingest(tmp_path, name: str, pool: str | None) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if pool:
        env["ARROW_DEFAULT_MEMORY_POOL"] = pool
    out = tmp_path / f"{pool or 'unset'}.jsonl"
    proc = subprocess.run([sys.executable, "-c", INGEST_THEN_POOL, str(trace_path(name)), str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    backend, rc = proc.stdout.split()[-2:]
    assert rc == "0"
    return backend, hashlib.md5(out.read_bytes()).hexdigest()


def test_ingest_runs_on_the_system_pool_and_writes_the_same_bytes_as_on_the_default_pool(tmp_path):
    backend, ours = _ingest(tmp_path, "a100/cuda_graphs_rank0_of16.json.gz", None)
    assert backend == "system"
    default_backend, theirs = _ingest(tmp_path, "a100/cuda_graphs_rank0_of16.json.gz", "mimalloc")
    assert default_backend == "mimalloc"  # the user's choice stands
    assert ours == theirs


def test_a_pool_the_user_chose_stands_and_the_environment_is_untouched():
    env = {"ARROW_DEFAULT_MEMORY_POOL": "mimalloc"}
    code = ("import os, pyarrow as pa\n"
            "from plasmient_trace.arrow_memory import use_offline_pool\n"
            "print(use_offline_pool(), pa.default_memory_pool().backend_name)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})
    assert proc.stdout.split() == ["mimalloc", "mimalloc"], proc.stderr
    # unset: the system pool for this process only; nothing a child (a traced job under `plasmient run`) would inherit
    code = ("import os, pyarrow as pa\n"
            "from plasmient_trace.arrow_memory import use_offline_pool\n"
            "print(use_offline_pool(), 'ARROW_DEFAULT_MEMORY_POOL' in os.environ)\n")
    clean = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=clean)
    assert proc.stdout.split() == ["system", "False"], proc.stderr


def test_rank_pool_workers_run_on_the_same_pool():
    from plasmient_trace.runners import PoolRunner

    runner = PoolRunner(workers=1, n_ranks=1)
    try:
        saved = os.environ.pop("ARROW_DEFAULT_MEMORY_POOL", None)
        try:
            backend = runner.pool.submit(eval, "__import__('pyarrow').default_memory_pool().backend_name").result(timeout=120)
        finally:
            if saved is not None:
                os.environ["ARROW_DEFAULT_MEMORY_POOL"] = saved
    finally:
        runner.close()
    assert backend == "system"
