"""The typed decoder against an independent reading of the same files with json.load: every kernel's
times, name, correlation and shape, and Inductor's per-kernel FLOPs and bytes where a file has them."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from conftest import ALL_TRACES, raw_trace, trace_path

from plasmient_trace.sources.kineto import read_kineto

GPU_CATS = ("kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset")


@pytest.mark.parametrize("name", ALL_TRACES)
def test_kernel_table_matches_the_raw_json(name):
    doc = raw_trace(name)
    raw = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    kernels = read_kineto(trace_path(name)).kernels
    assert kernels.num_rows == len(raw)
    if not raw:
        return
    # Durations in ns from the µs floats, and start offsets relative to the first kernel.
    dur = np.rint(np.array([e["dur"] for e in raw], np.float64) * 1000).astype(np.int64)
    got_start = kernels.column("start_ns").to_numpy()
    assert np.array_equal(kernels.column("end_ns").to_numpy() - got_start, dur)
    ts = np.array([e["ts"] for e in raw], np.float64)
    assert np.allclose(got_start - got_start[0], (ts - ts[0]) * 1000, atol=1)
    assert kernels.column("name").to_pylist() == [e["name"] for e in raw]
    assert kernels.column("correlation_id").to_pylist() == [e.get("args", {}).get("correlation") for e in raw]
    grids = [g if isinstance(g := e.get("args", {}).get("grid"), list) and len(g) == 3 else None for e in raw]
    assert kernels.column("grid").to_pylist() == grids
    # No shared trace was recorded with Inductor's benchmark_kernel: its per-kernel numbers are unknown.
    assert kernels.column("model_flops").null_count == kernels.num_rows


def _inductor_trace(tmp_path, kernel_args: list[dict]):
    events = [{"ph": "X", "cat": "kernel", "name": f"triton_poi_fused_{i}", "pid": 0, "tid": 7,
               "ts": 1000.0 + 10 * i, "dur": 4.5, "args": {"device": 0, "stream": 7, "correlation": i + 1, **args}}
              for i, args in enumerate(kernel_args)]
    path = tmp_path / "inductor.json.gz"
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    return path


def test_inductor_kernel_flop_and_num_gb_become_per_kernel_flops_and_bytes(tmp_path):
    path = _inductor_trace(tmp_path, [
        {"kernel_flop": 2_097_152, "kernel_num_gb": 0.012582912},   # a 128x128x64 fused mm + its traffic
        {"kernel_num_gb": 0.0004},                                    # pointwise: bytes only
        {},                                                           # not annotated: unknown, not 0
        {"kernel_flop": -5, "kernel_num_gb": -1.0},                   # impossible: unknown, counted
    ])
    records = read_kineto(path)
    kernels = records.kernels
    assert kernels.column("model_flops").to_pylist() == [2_097_152.0, None, None, None]
    # kernel_num_gb is in GB (1e9 bytes)
    assert kernels.column("model_bytes").to_pylist() == [pytest.approx(12_582_912.0), pytest.approx(400_000.0), None, None]
    assert records.counters["input.invalid_values"] == 2


OP_CATS = ("cpu_op", "Operator", "user_annotation")


def _compact(value):
    return None if value is None else json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("name", ALL_TRACES)
def test_op_argument_lists_are_the_raw_jsons_values_as_compact_text(name):
    """Input Dims / Input type / Concrete Inputs are kept as compact JSON text of the file's values, however
    the file spaces them (the h100 traces are pretty-printed across lines); Input Strides only where an
    input is broadcast (a 0 stride over a dimension longer than 1)."""
    doc = raw_trace(name)
    raw = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in OP_CATS
           and not (e.get("name", "").startswith("ProfilerStep#") and e["name"][len("ProfilerStep#"):].isdigit())]
    ops = read_kineto(trace_path(name)).ops
    assert ops.num_rows == len(raw)
    args = [e.get("args", {}) for e in raw]
    for column, key in (("input_dims", "Input Dims"), ("input_types", "Input type"), ("concrete_inputs", "Concrete Inputs")):
        assert ops.column(column).to_pylist() == [_compact(a.get(key)) for a in args], column

    def broadcast(a):
        strides, dims = a.get("Input Strides"), a.get("Input Dims")
        if not isinstance(strides, list) or not isinstance(dims, list):
            return None
        for st, d in zip(strides, dims):
            if isinstance(st, list) and isinstance(d, list) and len(st) == len(d) \
                    and any(k == 0 and isinstance(n, int) and n > 1 for k, n in zip(st, d)):
                return _compact(strides)
        return None

    assert ops.column("input_strides").to_pylist() == [broadcast(a) for a in args]


def test_argument_lists_and_kernel_names_past_the_cache_bound_read_the_same(tmp_path, monkeypatch):
    """The per-file caches stop growing at their byte bound (a hostile file of millions of distinct long
    argument lists must not be held twice); what comes after is parsed each time, to the same values."""
    from plasmient_trace.sources import kineto

    monkeypatch.setattr(kineto, "_CACHE_KEY_BYTES", 600)
    events = []
    for i in range(200):
        dims = [[i, 3], [], [i % 7]]
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 10 * i, "dur": 5, "pid": 1, "tid": 1,
                       "args": {"External id": i + 1, "Input Dims": dims, "Input type": ["float", "", "Scalar"],
                                "Input Strides": [[0, 1], [], []] if i % 2 else None}})
        events.append({"ph": "X", "cat": "kernel", "name": f"ncclDevKernel_AllReduce_{i}" if i % 3 == 0 else f"gemm_{i}",
                       "ts": 10 * i + 1, "dur": 2, "pid": 0, "tid": 7, "args": {"device": 0, "stream": 7, "correlation": i + 1,
                                                                                "External id": i + 1}})
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}, indent=2))  # spaced across lines, as h100 traces are
    records = read_kineto(path)
    ops = records.ops
    assert ops.column("input_dims").to_pylist() == [_compact(e["args"]["Input Dims"]) for e in events if e["cat"] == "cpu_op"]
    assert ops.column("input_types").to_pylist() == ['["float","","Scalar"]'] * 200
    # a 0 stride over a dimension longer than 1 is a broadcast: kept for odd i with i > 1
    assert ops.column("input_strides").to_pylist() == ['[[0,1],[],[]]' if i % 2 and i > 1 else None for i in range(200)]
    kinds = records.kernels.column("kind").to_pylist()
    assert kinds == ["collective" if i % 3 == 0 else "kernel" for i in range(200)]
