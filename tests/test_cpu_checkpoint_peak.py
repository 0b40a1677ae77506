"""Live capture on a CPU of a job with activation checkpointing and torch's default early stop: the recompute
stops, by raising inside the op that saves the last tensor it needs, before that op (the last Linear's
aten::addmm) runs its GEMM. The cut-off op is no work: it must neither be credited its 537 MFLOPs nor, at that
rate in 0.1 ms (5.8 TFLOP/s on a CPU that does 94 GFLOP/s), raise the CPU's calibrated peak that every later run
on the machine reads its MFU against."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from plasmient_trace.export.otlp_json import read_jsonl

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
STEPS = 3
JOB = f"""
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

torch.set_num_threads(1)
torch.manual_seed(0)
f = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
opt = torch.optim.SGD(f.parameters(), 1e-4)
for _ in range({STEPS}):
    x = torch.randn(256, 512, requires_grad=True)
    opt.zero_grad(set_to_none=True)
    checkpoint(f, x, use_reentrant=False).pow(2).mean().backward()   # early stop: torch's default
    opt.step()
"""


def _flop_counter_step() -> float:
    """What FlopCounterMode sees run in one step of the job (recompute included), with plasmient's bias term
    for addmm (docs/flops.md): it counts at dispatch, below autograd, so an op cut off before its kernel is
    not in it."""
    from torch import nn
    from torch.utils.checkpoint import checkpoint
    from torch.utils.flop_counter import FlopCounterMode, mm_flop

    def addmm_with_bias(self_shape, a, b, *args, out_shape=None, **kwargs):
        return mm_flop(a, b) + a[0] * b[1]

    torch.manual_seed(0)
    f = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
    x = torch.randn(256, 512, requires_grad=True)
    with FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm: addmm_with_bias}) as counter:
        checkpoint(f, x, use_reentrant=False).pow(2).mean().backward()
    return float(counter.get_total_flops())


@pytest.fixture(scope="module")
def run(tmp_path_factory, warm_cache: Path) -> dict:
    tmp = tmp_path_factory.mktemp("ckpt-peak")
    cache = tmp / "cache"   # this run's own copy: it must not touch the suite's calibration or the user's
    shutil.copytree(warm_cache, cache)
    calibration = cache / "cpu_calibration.json"
    before = json.loads(calibration.read_text())
    (tmp / "job.py").write_text(JOB)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PLASMIENT_"))}
    env.update(PYTHONPATH=str(REPO), PLASMIENT_JOB_ID="ckpt-peak", PLASMIENT_CACHE_DIR=str(cache))
    done = subprocess.run([sys.executable, "-m", "plasmient_trace.cli", "run", "--out", str(tmp / "t.jsonl"),
                           "--every", "1", "--", sys.executable, str(tmp / "job.py")],
                          cwd=tmp, env=env, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()
    rows = read_jsonl(tmp / "t.jsonl").table.to_pylist()
    return {"before": before, "after": json.loads(calibration.read_text()), "rows": rows}


def test_an_op_cut_off_by_checkpoints_early_stop_leaves_the_cached_cpu_peak_as_it_was(run: dict) -> None:
    assert run["after"] == run["before"]
    steps = [r for r in run["rows"] if r["plasmient.level"] == "step"]
    assert len(steps) == STEPS
    key = next(k for k in run["before"] if k.endswith("|threads=1"))
    for s in steps:   # every step's MFU is read against the measured peak
        assert s["plasmient.peak_flops"] == pytest.approx(run["before"][key]["fp32"], rel=1e-12)


def test_each_steps_gemm_flops_and_recompute_are_what_flop_counter_mode_saw_run(run: dict) -> None:
    counted = _flop_counter_step()
    steps = [r for r in run["rows"] if r["plasmient.level"] == "step"]
    for step in steps:
        assert step["plasmient.flops.source"] == "measured"   # a full-depth step: its own ops, not carried
        ops = [r for r in run["rows"] if r["trace_id"] == step["trace_id"] and r["plasmient.level"] == "op"]
        # The GEMMs are leaves here, and FlopCounterMode counts only GEMMs: they must agree to the FLOP.
        gemm = sum((r["plasmient.flops"] or 0) + (r["plasmient.flops.recompute"] or 0)
                   for r in ops if r["name"] in ("aten::addmm", "aten::mm"))
        assert gemm == counted
        # The step's total is that and the elementwise and reduction work FlopCounterMode leaves out (GELU,
        # the loss, SGD's update: about 5 MFLOPs), far from the cut-off GEMM's 537 MFLOPs.
        total = step["plasmient.flops"] + (step["plasmient.flops.recompute"] or 0)
        assert counted <= total <= 1.01 * counted
        # the cut-off op is recorded (its time was spent), with its FLOPs unknown, not credited
        cut = [r for r in ops if r["name"] == "aten::addmm" and r["plasmient.op.flops_model"] == "none"]
        assert len(cut) == 1 and cut[0]["plasmient.flops"] is None and cut[0]["plasmient.flops.recompute"] is None
