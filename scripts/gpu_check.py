"""First-run check of live capture on a CUDA machine (``scripts/gpu-check.sh`` runs it; < 8 minutes).

For each workload (the tiny transformer training on the GPU; a decode loop and a large GEMM as
explicit inference steps) it:

1. runs ``--steps`` steps under live capture at full depth (CUPTI + NVML), recording every raw CUPTI
   activity buffer the session flushes;
2. runs the same steps again (same seed, same inputs) under torch.profiler and ingests its trace;
3. compares, step by step, which op each kernel joined to: the live path joins by CUPTI external
   correlation ids, torch.profiler's trace by its External ids, both through the same stitcher, so
   the multisets of (parent op, kernel) pairs must be equal;
4. writes the raw buffers as fixtures (``tests/fixtures/gpu/<workload>/step<k>.json``) for tests
   that need no GPU, and prints a one-screen report. Exit 0 when every join agreed.

Without CUDA it says SKIPPED and exits 0. ``--device cpu`` runs the same plumbing on the CPU (no
kernels, so no join is checked) to catch mistakes before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))


def _workloads(device: str) -> dict[str, Callable[[], Callable[[], None]]]:
    """name -> setup returning one step's function (optimizer steps, or an explicit capture.step())."""
    import torch

    def tiny() -> Callable[[], None]:
        import train_tiny_transformer as tt

        model, opt, data = tt.build(dim=256, layers=2, batch=16, seed=0)
        model, data = model.to(device), data.to(device)
        return lambda: tt.train_step(model, opt, data)

    def decode_gemm() -> Callable[[], None]:
        torch.manual_seed(0)
        layers = torch.nn.ModuleList(torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)).to(device).eval()
        a = torch.randn(4096, 4096, device=device)
        b = torch.randn(4096, 4096, device=device)
        tokens = torch.randn(8, 1, 2048, device=device)

        def step() -> None:
            from plasmient_trace import capture

            with torch.no_grad(), capture.step():
                for t in range(tokens.shape[0]):
                    x = tokens[t]
                    for layer in layers:
                        x = layer(x)
                torch.mm(a, b)
                if device == "cuda":
                    torch.cuda.synchronize()

        return step

    return {"tiny_transformer": tiny, "decode_gemm": decode_gemm}


def _joins(table: Any) -> dict[int, Counter]:
    """step -> Counter of (parent span name, kernel name) over the kernel spans."""
    rows = table.select(["span_id", "parent_span_id", "name", "plasmient.level", "plasmient.step"]).to_pylist()
    name_of = {r["span_id"]: r["name"] for r in rows}
    out: dict[int, Counter] = {}
    for r in rows:
        if r["plasmient.level"] == "kernel":
            out.setdefault(r["plasmient.step"], Counter())[(name_of.get(r["parent_span_id"], "?"), r["name"])] += 1
    return out


def _step_rows(table: Any) -> list[dict[str, Any]]:
    cols = [c for c in ("plasmient.step", "plasmient.mfu", "plasmient.util.resident", "plasmient.util.nvml",
                        "plasmient.flops", "plasmient.wall_s") if c in table.column_names]
    return [r for r in table.select(cols + ["plasmient.level"]).to_pylist() if r["plasmient.level"] == "step"]


def _capture(name: str, setup: Callable[[], Callable[[], None]], steps: int) -> tuple[Any, list[dict], bool]:
    import pyarrow as pa

    from plasmient_trace import capture
    from plasmient_trace.capture import cupti
    from plasmient_trace.capture.session import CaptureConfig

    recorded: list[dict] = []
    original = cupti.CuptiCollector.flush

    def flush(self: Any) -> Any:
        buf, dropped = original(self)
        recorded.append({"gpu": dict(buf.gpu), "api": dict(buf.api), "ext": dict(buf.ext), "dropped": dropped,
                         "epoch_offset_ns": getattr(self, "epoch_offset_ns", 0)})
        return buf, dropped

    cupti.CuptiCollector.flush = flush
    batches: list[Any] = []
    try:
        step = setup()
        step()  # warm-up (cuBLAS handles, allocator) before the capture starts
        session = capture.start(CaptureConfig.from_env(every=1, job_id=f"gpu-check-{name}", flush_timeout_s=120.0),
                                exporters=[("memory", batches.append)])
        if session is None:
            raise RuntimeError("live capture did not start")
        for _ in range(steps):
            step()
        on_gpu = bool(session.on_gpu)
        capture.stop(timeout=120)
    finally:
        cupti.CuptiCollector.flush = original
    tables = [b.table for b in batches if len(b)]
    return (pa.concat_tables(tables, promote_options="default") if tables else None), recorded, on_gpu


def _profile(setup: Callable[[], Callable[[], None]], steps: int, device: str, workdir: Path) -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    step = setup()
    step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
            prof.step()
    path = workdir / "profiler.json"
    prof.export_chrome_trace(str(path))
    del torch
    return ingest_paths([path], IngestOptions(job_id="gpu-check-profiler")).batch.table


def _save_fixtures(directory: Path, name: str, recorded: list[dict], device_name: str) -> list[Path]:
    import torch

    out = directory / name
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, buf in enumerate(recorded):
        path = out / f"step{k}.json"
        doc = {"workload": name, "step": k, "device": device_name, "torch": torch.__version__, **buf}
        path.write_text(json.dumps(doc, default=lambda v: list(v) if isinstance(v, tuple) else str(v)))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--fixtures", type=Path, default=REPO / "tests" / "fixtures" / "gpu",
                   help="where the raw activity buffers go (default tests/fixtures/gpu)")
    args = p.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: SKIPPED: torch sees no CUDA device (torch.cuda.is_available() is False); nothing was checked")
        return 0
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    t0 = time.monotonic()
    lines = [f"gpu-check on {device_name}, torch {torch.__version__}, {args.steps} steps per workload"]
    ok = True
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name, setup in _workloads(args.device).items():
            try:
                ours, recorded, on_gpu = _capture(name, setup, args.steps)
                theirs = _profile(setup, args.steps, args.device, Path(tmp))
            except Exception as err:  # one workload failing must not hide the others' results
                ok = False
                lines.append(f"  {name}: FAILED: {type(err).__name__}: {err}")
                continue
            if ours is None:
                ok = False
                lines.append(f"  {name}: FAILED: the capture produced no spans")
                continue
            mine, prof = _joins(ours), _joins(theirs)
            pairs = [(mine[a], prof[b]) for a, b in zip(sorted(mine), sorted(prof))]
            kernels = sum(sum(m.values()) for m, _ in pairs)
            agree = sum(sum((m & t).values()) for m, t in pairs)
            differ = [k for m, t in pairs for k in ((m - t) + (t - m))]
            same = bool(pairs) and not differ and len(mine) == len(prof)
            if args.device == "cuda":
                ok &= same and on_gpu
            fixtures = _save_fixtures(args.fixtures, name, recorded, device_name) if recorded else []
            steps = _step_rows(ours)
            mfu = [r.get("plasmient.mfu") for r in steps]
            nvml = [r.get("plasmient.util.nvml") for r in steps]
            verdict = ("OK" if same else "DIFFER") if args.device == "cuda" else "n/a: no kernels on a CPU"
            lines.append(f"  {name}: {len(steps)} steps, CUPTI {'on' if on_gpu else 'OFF'}, {kernels} kernels joined, "
                         f"{agree}/{kernels} joins as torch.profiler ({verdict})")
            lines.append(f"    MFU per step {['-' if v is None else f'{v:.3f}' for v in mfu]}, "
                         f"NVML util {['-' if v is None else f'{v:.0f}' for v in nvml]}")
            for parent, kernel in differ[:3]:
                lines.append(f"    differs: {parent} -> {kernel[:90]}")
            if fixtures:
                lines.append(f"    {len(fixtures)} raw activity buffers -> {fixtures[0].parent}")
    lines.append(f"{'PASS' if ok else 'FAIL'} in {time.monotonic() - t0:.0f}s")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
