"""torch.compile on a CPU: Inductor's fused C++ kernels are ops of a live capture (``capture.inductor_kernels``
turns on ``cpp.enable_kernel_profile`` while it runs), so a compiled step's norms and activations are busy
time of unknown FLOPs, not invisible. Checked against torch.profiler's own record of the same compiled code."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
inductor_config = pytest.importorskip("torch._inductor.config")

from capture_helpers import live_capture  # noqa: E402

from plasmient_trace.capture.inductor_kernels import ENV_VAR, InductorKernelNames  # noqa: E402


def _fused(names) -> list[str]:
    """The fused kernels' names without Inductor's graph number (graph_0_, graph_4_: a count of the graphs
    compiled in the process so far, which a recompile moves on)."""
    return sorted(re.sub(r"^graph_\d+_", "", n) for n in names if "cpp_fused" in n)


def test_a_compiled_cpu_step_shows_inductor_s_fused_kernels_as_ops_as_torch_profiler_records_them():
    from torch.profiler import ProfilerActivity, profile

    assert inductor_config.cpp.enable_kernel_profile is False
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64), nn.LayerNorm(64))
    x = torch.randn(32, 64)
    with live_capture(every=1, peak_tflops=0.05, job_id="inductor") as (session, sink):
        compiled = torch.compile(model)  # compiled while the capture runs
        for _ in range(2):
            compiled(x).sum().backward()
        with session.step():
            compiled(x).sum().backward()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            compiled(x).sum().backward()
    assert inductor_config.cpp.enable_kernel_profile is False  # put back at close

    recorded = _fused(e.name for e in prof.events())
    assert len(recorded) >= 2  # forward and backward kernels, as the profiler names them
    rows = sink.rows()
    step = max(r["plasmient.step"] for r in rows if r["plasmient.level"] == "step")
    ops = [r for r in rows if r["plasmient.level"] == "op" and r["plasmient.step"] == step]
    fused = [r for r in ops if "cpp_fused" in r["name"]]
    assert _fused(r["name"] for r in fused) == recorded
    for r in fused:
        assert r["plasmient.busy_s"] > 0 and r["plasmient.flops.coverage"] == 0
        assert r["plasmient.flops"] is None and r["plasmient.op.model_flops"] is None  # unknown, not 0
    for wrapper in (r for r in ops if r["name"] in ("CompiledFunction", "CompiledFunctionBackward")):
        # the wrapper's busy time is its kernels': the extern GEMMs and now the fused kernels
        children = [r for r in ops if r["parent_span_id"] == wrapper["span_id"]]
        assert any("cpp_fused" in c["name"] for c in children), wrapper["name"]
        assert wrapper["plasmient.busy_s"] == pytest.approx(sum(c["plasmient.busy_s"] or 0.0 for c in children), abs=1e-9)
        assert 0 < wrapper["plasmient.flops.coverage"] < 1


def test_a_job_that_sets_the_inductor_variable_itself_is_left_as_it_chose():
    for value in ("0", "1"):
        names = InductorKernelNames(environ={ENV_VAR: value})
        names.install()
        assert inductor_config.cpp.enable_kernel_profile is False
        names.uninstall()


def test_a_value_the_job_changed_during_the_capture_is_not_put_back():
    names = InductorKernelNames(environ={})
    names.install()
    assert inductor_config.cpp.enable_kernel_profile is True
    inductor_config.cpp.enable_kernel_profile = "job's"  # any value of the job's own
    try:
        names.uninstall()
        assert inductor_config.cpp.enable_kernel_profile == "job's"
    finally:
        inductor_config.cpp.enable_kernel_profile = False
