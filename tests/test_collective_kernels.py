"""Kernels that move data between GPUs are communication, whichever library launched them: NCCL's, and the
peer-to-peer kernels of torch's symmetric memory that vLLM all-reduces with on b200/eager (18% of its device
time). Checked against the raw JSON, where the op that launched each kernel says what it is."""

from __future__ import annotations

import pytest
from conftest import ingested, raw_trace

B200 = "b200/eager_rank0_of8.json.gz"
ALL_REDUCE_OP = "symm_mem::multimem_all_reduce_"


def _launched_by(name: str, op_name: str) -> set[int]:
    """Correlation ids of the kernels whose launch (a runtime event) lies inside an op named ``op_name`` on the
    same thread, read from the raw JSON."""
    events = [e for e in raw_trace(name)["traceEvents"] if e.get("ph") == "X"]
    ops = [(e["tid"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
           if e.get("cat") == "cpu_op" and e["name"] == op_name]
    launches = {e["args"]["correlation"]: (e["tid"], float(e["ts"])) for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    kernels = {e["args"]["correlation"] for e in events if e.get("cat") == "kernel"}
    return {c for c, (tid, ts) in launches.items() if c in kernels and any(t == tid and a <= ts <= b for t, a, b in ops)}


def test_symmetric_memory_all_reduce_kernels_are_communication_with_no_unknown_flops():
    corr = _launched_by(B200, ALL_REDUCE_OP)
    assert len(corr) == 73
    rows = ingested(B200, 10**7).batch.table.to_pylist()
    kernels = [r for r in rows if r["plasmient.level"] == "kernel" and r["plasmient.correlation_id"] in corr]
    assert len(kernels) == len(corr)
    for r in kernels:
        assert r["plasmient.kernel.kind"] == "collective" and r["plasmient.bound"] == "communication", r["name"]
        # no FLOPs, known: a collective is data movement (its byte count is unknown without NCCL's metadata)
        assert r["plasmient.flops"] == 0 and r["plasmient.flops.coverage"] == pytest.approx(1.0)
        assert r["plasmient.comm.bytes"] is None
    ops = [r for r in rows if r["plasmient.level"] == "op" and r["name"] == ALL_REDUCE_OP]
    assert len(ops) == 73 and all(r["plasmient.flops.coverage"] == pytest.approx(1.0) for r in ops)
