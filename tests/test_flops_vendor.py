"""Vendor ops (metrics/flops/vendor.py) on the shapes vLLM recorded in ../shared/traces/b200, with
each op's documented semantics turned into the expected count in the test."""

from __future__ import annotations

from conftest import raw_trace
from plasmient_trace.metrics import flops as F


def test_vllm_b200_norms_and_fp8_quant_from_recorded_shapes() -> None:
    events = [e for e in raw_trace("b200/eager_rank0_of8.json.gz")["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") == "cpu_op"]

    def first(name: str) -> dict:
        return next(e for e in events if e["name"] == name)

    def cost(e: dict) -> tuple[float, float, str, str]:
        a = e["args"]
        return F.op_cost(e["name"], a["Input Dims"], a["Input type"], a.get("Concrete Inputs"))

    # fp8 quant: out [888, 512] fp8, input [888, 512] bf16, scale: one multiply per element;
    # reads bf16 in, writes fp8 out.
    q = first("_C::static_scaled_fp8_quant")
    (rows, cols) = q["args"]["Input Dims"][1]
    assert cost(q)[0] == rows * cols and cost(q)[1] == rows * cols * (2 + 1) + 4 and cost(q)[3] == "elementwise"
    # residual add then RMS norm with a weight: 1 + 4 per element of [888, 2880].
    n = first("_C::fused_add_rms_norm")
    assert cost(n)[0] == 5 * 888 * 2880 and cost(n)[3] == "norm"
