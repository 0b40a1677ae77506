"""Activation checkpointing, offline and live: recomputed forward work is hardware FLOPs (plasmient.hfu), not model FLOPs
(plasmient.mfu), checked against torch's FlopCounterMode on a model recorded here and on the real MI300X
ResNet trace that was recorded with checkpointing."""

from __future__ import annotations

import contextlib
from functools import lru_cache

import pytest

from conftest import ingested

torch = pytest.importorskip("torch")


def _model(checkpointed: bool):
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):  # bias-free GEMMs only: FlopCounterMode counts exactly what is recomputed
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(64, 256, bias=False), nn.Linear(256, 64, bias=False)

        def forward(self, x):
            return self.down(self.up(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(3)])

        def forward(self, x):
            for b in self.blocks:
                x = checkpoint(b, x, use_reentrant=False) if checkpointed else b(x)
            return x.sum()

    torch.manual_seed(0)
    return Net()


def _counted_flops(checkpointed: bool) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    model, x = _model(checkpointed), torch.randn(32, 64)
    with _full_recompute(), FlopCounterMode(display=False) as counter:
        model(x).backward()
    return counter.get_total_flops()


def _full_recompute():
    # Early stopping ends a recompute once the saved tensors exist, and whether it triggers differs
    # under a dispatch mode (FlopCounterMode) and under the profiler: turn it off so both runs recompute
    # the same ops.
    from torch.utils.checkpoint import set_checkpoint_early_stop

    return set_checkpoint_early_stop(False)


@lru_cache(maxsize=None)
def _step(tmp: str, checkpointed: bool) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    model, x = _model(checkpointed), torch.randn(32, 64)
    with _full_recompute():
        model(x).backward()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            model(x).backward()
    path = f"{tmp}/{'ckpt' if checkpointed else 'plain'}.json"
    prof.export_chrome_trace(path)
    rows = ingest_paths([path], IngestOptions(job_id="ckpt", peak_tflops=1.0)).batch.table.to_pylist()
    return next(r for r in rows if r["plasmient.level"] == "step")


def test_recomputed_forward_is_hfu_not_mfu(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    plain, ckpt = _step(tmp, False), _step(tmp, True)
    recomputed = _counted_flops(True) - _counted_flops(False)
    assert recomputed == 3 * 2 * 2 * 32 * 64 * 256  # FlopCounterMode: the three blocks' forward GEMMs again
    # model FLOPs do not change with checkpointing; the recompute is reported beside them
    assert ckpt["plasmient.flops"] == pytest.approx(plain["plasmient.flops"], rel=1e-12)
    assert ckpt["plasmient.flops.recompute"] == pytest.approx(recomputed, rel=1e-12)
    assert plain["plasmient.flops.recompute"] is None and plain["plasmient.hfu"] == pytest.approx(plain["plasmient.mfu"])
    assert ckpt["plasmient.hfu"] > ckpt["plasmient.mfu"]


def test_recompute_on_the_mi300x_resnet_sits_in_the_backward_of_its_module():
    rows = ingested("mi300x/resnet_act_checkpoint_rank0_of8.json.gz", 10**7).batch.table.to_pylist()
    index = {(r["trace_id"], r["span_id"]): r for r in rows}
    steps = [r for r in rows if r["plasmient.level"] == "step"]
    assert all(s["plasmient.flops.recompute"] > 0 and s["plasmient.hfu"] > s["plasmient.mfu"] for s in steps)
    recompute = [r for r in rows if r["plasmient.level"] == "module" and r["name"].endswith(" [recompute]")]
    assert recompute
    for m in recompute:
        parent = index[(m["trace_id"], m["parent_span_id"])]
        if parent["plasmient.level"] == "module":
            assert parent["name"].endswith(" [recompute]")  # nested recompute modules
            continue
        # a top recompute module hangs under the backward op that re-ran it, inside a [backward] module
        assert parent["plasmient.level"] == "op" and "Backward" in parent["name"]
        up = parent
        while up["plasmient.level"] == "op":
            up = index[(up["trace_id"], up["parent_span_id"])]
        assert up["plasmient.level"] in ("module", "step")
        if up["plasmient.level"] == "module":
            assert up["name"].endswith(" [backward]")
    # the forward convolutions under a recompute module carry no model FLOPs: their work is recompute
    convs = [r for r in rows if r["plasmient.level"] == "op" and r["name"] == "aten::convolution"
             and index[(r["trace_id"], r["parent_span_id"])]["name"].startswith("aten::conv2d")]
    in_recompute = []
    for c in convs:
        up = c
        while up["parent_span_id"] and up["plasmient.level"] != "step":
            up = index[(up["trace_id"], up["parent_span_id"])]
            if up["name"].endswith(" [recompute]"):
                in_recompute.append(c)
                break
    assert in_recompute and all((c["plasmient.flops"] or 0) == 0 and c["plasmient.flops.recompute"] > 0
                                for c in in_recompute if c["plasmient.device.window_s"])


def _live_steps(checkpointed: bool) -> tuple[list[dict], list[dict]]:
    from capture_helpers import Collect

    from plasmient_trace.capture.session import CaptureConfig, CaptureSession

    sink = Collect()
    session = CaptureSession(CaptureConfig(every=1, peak_tflops=0.05, job_id="ck", environ={}),
                             exporters=[("memory", sink)]).start()
    try:
        model, x = _model(checkpointed), torch.randn(32, 64)
        with _full_recompute():
            for _ in range(2):
                with session.step():
                    model(x).backward()
    finally:
        session.close(timeout=30)
    rows = sink.rows()
    return [r for r in rows if r["plasmient.level"] == "step"], rows


def test_live_capture_separates_the_recompute_too():
    plain, _ = _live_steps(False)
    ckpt, rows = _live_steps(True)
    recomputed = _counted_flops(True) - _counted_flops(False)
    for p, c in zip(sorted(plain, key=lambda r: r["plasmient.step"]), sorted(ckpt, key=lambda r: r["plasmient.step"])):
        assert c["plasmient.flops"] == pytest.approx(p["plasmient.flops"], rel=1e-12)
        assert c["plasmient.flops.recompute"] == pytest.approx(recomputed, rel=1e-12)
        assert p["plasmient.flops.recompute"] is None
    names = {r["name"] for r in rows if r["plasmient.level"] == "module"}
    assert {"Net.blocks.0 [recompute]", "Net.blocks.0.up [recompute]"} <= names


def test_gradient_accumulation_on_the_mi300x_resnet_follows_the_node_that_produced_it():
    """Every evaluate_function: AccumulateGrad root (62 per step in the raw JSON) sits where the backward root
    that ran just before it on its thread sits (the autograd engine runs a gradient's accumulation right after
    its producer), inside a [backward] module, never flat under the step."""
    from conftest import raw_trace

    raw = [e for e in raw_trace("mi300x/resnet_act_checkpoint_rank0_of8.json.gz")["traceEvents"]
           if e.get("ph") == "X" and str(e.get("name", "")).startswith("autograd::engine::evaluate_function: ")]
    rows = ingested("mi300x/resnet_act_checkpoint_rank0_of8.json.gz", 10**7).batch.table.to_pylist()
    index = {(r["trace_id"], r["span_id"]): r for r in rows}
    roots = sorted((r for r in rows if r["plasmient.level"] == "op" and r["name"].startswith("autograd::engine::evaluate_function: ")
                    and index[(r["trace_id"], r["parent_span_id"])]["plasmient.level"] != "op"),
                   key=lambda r: (r["trace_id"], r["thread.id"], r["start_ns"]))
    grads = [r for r in roots if r["name"].endswith("AccumulateGrad")]
    assert len(grads) == sum(e["name"].endswith("AccumulateGrad") for e in raw) == 186
    producer = None
    for r in roots:
        if not r["name"].endswith("AccumulateGrad"):
            producer = r
            continue
        parent = index[(r["trace_id"], r["parent_span_id"])]
        assert parent["plasmient.level"] == "module" and parent["name"].endswith(" [backward]")
        assert producer is not None and producer["trace_id"] == r["trace_id"] and producer["thread.id"] == r["thread.id"]
        assert r["parent_span_id"] == producer["parent_span_id"]


def test_a_backward_that_builds_a_graph_is_model_work_not_recompute():
    """A gradient penalty (WGAN-GP; MAML and Hessian-vector products alike) differentiates with
    create_graph=True: autograd numbers those backward ops as it numbers a checkpoint's recomputed forward.
    They run no module's forward, so they are the model's FLOPs (FlopCounterMode counts them), not recompute."""
    from torch.utils.flop_counter import FlopCounterMode

    from capture_helpers import live_capture

    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256, bias=False), nn.Tanh(), nn.Linear(256, 1, bias=False))
    x = torch.randn(32, 64, requires_grad=True)

    def gradient_penalty_step() -> None:
        out = model(x)
        (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.mean() + grad.pow(2).sum()).backward()

    gradient_penalty_step()
    class _NoModuleTracking(contextlib.nullcontext):  # torch 2.13's module tracker fails under autograd.grad
        parents = {"Global"}

        def __exit__(self, *exc: object) -> None:
            return None

    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _NoModuleTracking()
    with counter:
        gradient_penalty_step()
    expected = counter.get_total_flops()
    with live_capture(every=1, peak_tflops=0.05, job_id="gp") as (session, sink):
        for _ in range(2):
            with session.step():
                gradient_penalty_step()
    steps = [r for r in sink.rows() if r["plasmient.level"] == "step"]
    assert len(steps) == 2
    for step in steps:
        assert step["plasmient.flops.recompute"] is None
        # FlopCounterMode counts the matmuls; plasmient also tanh, its derivative's and the penalty's elementwise math
        assert expected <= step["plasmient.flops"] <= 1.05 * expected, (step["plasmient.flops"], expected)


def test_a_checkpointed_functions_functional_ops_are_recompute_too():
    """A checkpointed function with functional ops beside its module (ReLU and a scale after a Linear): its
    recompute re-runs them outside any module call, in the backward node that re-ran the Linear. They are
    recompute: every op's model FLOPs are what the same step counts without checkpointing, except the
    gradient additions (aten::add_) checkpoint's own backward makes."""
    from collections import Counter

    from torch.utils.checkpoint import checkpoint

    from capture_helpers import live_capture

    nn = torch.nn
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(64, 64, bias=False) for _ in range(3)])
    x = torch.randn(32, 64, requires_grad=True)

    def step(checkpointed: bool) -> None:
        h = x
        for layer in layers:
            fn = lambda t, layer=layer: layer(t).relu() * 2.0  # noqa: E731
            h = checkpoint(fn, h, use_reentrant=False) if checkpointed else fn(h)
        h.sum().backward()

    per_op, recomputed = {}, {}
    for checkpointed in (False, True):
        with _full_recompute(), live_capture(every=1, peak_tflops=0.05, job_id="fn-ckpt") as (session, sink):
            with session.step():
                step(checkpointed)
        rows = sink.rows()
        per_op[checkpointed] = Counter()
        for r in rows:
            if r["plasmient.level"] == "op" and r["name"] != "aten::add_":
                per_op[checkpointed][r["name"]] += r.get("plasmient.flops.self") or 0.0
        recomputed[checkpointed] = next(r for r in rows if r["plasmient.level"] == "step")["plasmient.flops.recompute"]
    assert recomputed[False] is None and recomputed[True] > 0
    assert +per_op[True] == +per_op[False]
    assert per_op[False]["aten::clamp_min"] or per_op[False]["aten::relu"]  # the functional ops count, once
