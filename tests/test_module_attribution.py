"""An op belongs to the innermost nn.Module around it on its thread, whatever scope wraps the module calls.

Training and serving code wraps the model's forward in ``record_function`` scopes: DDP records
``DistributedDataParallel.forward`` around the wrapped module, vLLM an ``execute_context_…`` annotation around
the model, users a ``"forward"`` block. Such a scope is an op that encloses modules. The oracle reads the raw
trace's ``nn.Module:`` events itself: the op's module is the innermost one whose interval holds the op's start on
its thread, and its backward is charged to that module too.
"""

from __future__ import annotations

from collections import Counter

import pytest

from conftest import ingested, ns_of_us, raw_trace

MI300X_DDP = "mi300x/resnet_act_checkpoint_rank0_of8.json.gz"
B200_VLLM = "b200/eager_rank0_of8.json.gz"
BACKWARD_SCOPE = "autograd::engine::evaluate_function"


def _raw_modules(doc: dict) -> list[tuple[int, int, int, int, str]]:
    return [(e["pid"], e["tid"], ns_of_us(e["ts"]), ns_of_us(e["ts"]) + ns_of_us(e["dur"]), e["name"][len("nn.Module: "):])
            for e in doc["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") == "python_function" and e.get("name", "").startswith("nn.Module: ")]


def _innermost(modules: list, pid: int, tid: int, t: int) -> str | None:
    around = [m for m in modules if m[0] == pid and m[1] == tid and m[2] <= t < m[3]]
    return min(around, key=lambda m: m[3] - m[2])[4] if around else None


def raw_forward_modules(name: str, op: str) -> list[str | None]:
    """The innermost module of each forward ``op`` (outside every backward node), in time order."""
    doc = raw_trace(name)
    ops = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    backward = [(e["pid"], e["tid"], ns_of_us(e["ts"]), ns_of_us(e["ts"]) + ns_of_us(e["dur"]))
                for e in ops if e["name"].startswith(BACKWARD_SCOPE)]
    modules = _raw_modules(doc)
    out = []
    for e in sorted((e for e in ops if e["name"] == op), key=lambda e: e["ts"]):
        t = ns_of_us(e["ts"])
        if any(b[0] == e["pid"] and b[1] == e["tid"] and b[2] <= t < b[3] for b in backward):
            continue  # recomputed under activation checkpointing: a backward node runs it
        out.append(_innermost(modules, e["pid"], e["tid"], t))
    return out


def span_modules(name: str, op: str) -> list[tuple[str | None, str]]:
    """(last component of the nearest module span's path, that span's name) of each ``op`` span outside the
    backward pass, in time order."""
    rows = ingested(name).batch.table.to_pylist()
    by_id = {(r["trace_id"], r["span_id"]): r for r in rows}

    def ancestors(r):
        while r is not None:
            yield r
            r = by_id.get((r["trace_id"], r["parent_span_id"]))

    out = []
    for r in sorted((r for r in rows if r["name"] == op and r["plasmient.level"] == "op"), key=lambda r: r["start_ns"]):
        chain = list(ancestors(r))[1:]
        if any(a["name"].startswith(BACKWARD_SCOPE) for a in chain):
            continue
        module = next((a for a in chain if a["plasmient.level"] == "module"), None)
        out.append((module["plasmient.module.path"].split(".")[-1] if module else None, module["name"] if module else ""))
    return out


@pytest.mark.parametrize(("name", "op", "per_trace"), [
    (MI300X_DDP, "aten::conv2d", 20),                      # inside DistributedDataParallel.forward
    (B200_VLLM, "vllm::unified_attention_with_output", 36),  # inside vLLM's execute_context annotation
])
def test_ops_inside_a_scope_that_wraps_the_model_belong_to_their_own_modules(name, op, per_trace):
    expected = raw_forward_modules(name, op)
    got = span_modules(name, op)
    assert len(expected) == len(got) and len(got) % per_trace == 0 and len(set(expected)) == per_trace
    assert [m for m, _ in got] == expected
    assert not any(full.endswith("[backward]") or full.endswith("[recompute]") for _, full in got)


def test_ddp_backward_is_charged_to_the_layer_whose_forward_it_differentiates():
    # The raw join: a backward node's sequence number is that of the forward op it differentiates; that op's
    # innermost module owns the gradient work (recompute included, as it shares the module).
    doc = raw_trace(MI300X_DDP)
    modules = _raw_modules(doc)
    ops = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    fwd = {}
    for e in sorted(ops, key=lambda e: e["ts"]):
        seq = e.get("args", {}).get("Sequence number")
        if seq is not None and not e.get("args", {}).get("Fwd thread id") and not e["name"].startswith(BACKWARD_SCOPE):
            fwd.setdefault(seq, _innermost(modules, e["pid"], e["tid"], ns_of_us(e["ts"])))
    expected = Counter(fwd.get(e["args"].get("Sequence number")) for e in ops if e["name"] == "ConvolutionBackward0")
    rows = ingested(MI300X_DDP).batch.table.to_pylist()
    by_id = {(r["trace_id"], r["span_id"]): r for r in rows}
    got = Counter()
    for r in rows:
        if r["name"] == "ConvolutionBackward0" and r["plasmient.level"] == "op":
            a = r
            while a is not None and a["plasmient.level"] != "module":
                a = by_id.get((a["trace_id"], a["parent_span_id"]))
            assert a is not None and a["name"].endswith(" [backward]")
            got[a["plasmient.module.path"].split(".")[-1]] += 1
    assert sum(expected.values()) == 60 and len(expected) == 20 and got == expected


def test_live_ops_under_a_users_record_function_scopes_keep_their_layers():
    # A training loop that wraps its forward and its backward in record_function scopes, captured live at full
    # depth. On a CPU the autograd engine runs the backward on the calling thread, inside the scope.
    torch = pytest.importorskip("torch")
    from capture_helpers import live_capture

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    linears = {f"Sequential.{name}" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    x = torch.randn(8, 32)
    with live_capture(close_timeout=60, every=1, peak_tflops=1.0, job_id="scoped") as (session, sink):
        for _ in range(3):
            with session.step():
                with torch.autograd.profiler.record_function("forward"):
                    loss = model(x).pow(2).mean()
                with torch.autograd.profiler.record_function("backward"):
                    loss.backward()
    assert not session.failed
    rows = sink.rows()
    by_id = {(r["trace_id"], r["span_id"]): r for r in rows}
    assert sum(r["name"] == "forward" and r["plasmient.level"] == "op" for r in rows) == 3
    assert sum(r["name"] == "backward" and r["plasmient.level"] == "op" for r in rows) == 3

    def module_of(r) -> str | None:
        while r is not None and r["plasmient.level"] != "module":
            r = by_id.get((r["trace_id"], r["parent_span_id"]))
        return r["name"] if r is not None else None

    forward = Counter(module_of(r) for r in rows if r["name"] == "aten::linear" and r["plasmient.level"] == "op")
    assert forward == {name: 3 for name in linears}
    gelu = Counter(module_of(r) for r in rows if r["name"] == "aten::gelu" and r["plasmient.level"] == "op")
    assert gelu == {"Sequential.1": 3}
    # their gradients go to the same layers' backward spans, out of the scope around loss.backward()
    backward = Counter(module_of(r) for r in rows if r["name"] == "AddmmBackward0" and r["plasmient.level"] == "op")
    assert backward == {f"{name} [backward]": 3 for name in linears}
    assert Counter(module_of(r) for r in rows if r["name"] == "GeluBackward0") == {"Sequential.1 [backward]": 3}
