"""Print the accounting numbers of issue 9 for every shared trace: how many kernel-owning op spans read
`idle`, step windows against the elapsed device time, culprit waste against the step, and the span budget.

    .venv/bin/python scripts/measure_accounting.py [--max-spans N] [TRACE ...]

Works on older outputs too (falls back to plasmient.wall_s where there is no plasmient.device.window_s),
so the same command prints the before and after numbers.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from plasmient_trace.pipeline import IngestOptions, ingest_paths

TRACES = Path(__file__).resolve().parents[1].parent / "shared" / "traces"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--max-spans", type=int, default=10_000)
    args = ap.parse_args()
    paths = [Path(p) for p in args.traces] or sorted(TRACES.glob("*/*.json.gz"))
    print(f"{'trace':48} {'idle ops':>9} {'sum step':>10} {'elapsed':>10} {'worst culprit/step':>18} "
          f"{'max spans':>9} {'kernel spans':>12} {'coverage':>9}")
    for path in paths:
        result = ingest_paths([path], IngestOptions(job_id="m", max_spans=args.max_spans))
        rows = result.batch.table.to_pylist()
        by_id = {(r["trace_id"], r["span_id"]): r for r in rows}
        kernel_parents = {(r["trace_id"], r["parent_span_id"]) for r in rows if r["plasmient.level"] == "kernel"}
        ops = [by_id[k] for k in kernel_parents if k in by_id and by_id[k]["plasmient.level"] == "op"]
        idle_ops = sum(1 for r in ops if r["plasmient.bound"] == "idle") / len(ops) if ops else float("nan")
        steps = [r for r in rows if r["plasmient.level"] == "step"]
        window = [r.get("plasmient.device.window_s", r["plasmient.wall_s"]) or 0.0 for r in steps]
        # elapsed device time from the raw kernel records: first to last kernel that belongs to a step
        j = result.joined[0]
        alive = j.kernel_step >= 0
        elapsed = (j.kernel_end[alive].max() - j.kernel_start[alive].min()) / 1e9 if alive.any() else 0.0
        worst = 0.0
        for r, w in zip(steps, window):
            device_s = w * (r["plasmient.gpus"] or 1)
            if r["plasmient.culprit.wasted_s"] and device_s > 0:
                worst = max(worst, r["plasmient.culprit.wasted_s"] / device_s)
        per_trace = defaultdict(int)
        kernel_spans = 0
        for r in rows:
            per_trace[r["trace_id"]] += 1
            kernel_spans += r["plasmient.level"] == "kernel"
        name = str(path.relative_to(TRACES)) if path.is_relative_to(TRACES) else path.name
        print(f"{name:48} {idle_ops:9.0%} {sum(window) * 1e3:8.1f}ms {elapsed * 1e3:8.1f}ms {worst:18.2f} "
              f"{max(per_trace.values()):9d} {kernel_spans:12d} {_coverage(rows, steps):9.1%}")
    return 0


def _coverage(rows: list[dict], steps: list[dict]) -> float:
    """Busy-time share with known FLOPs: the steps' plasmient.flops.coverage; for outputs from before that
    attribute, the share of exported kernel time with FLOPs > 0 or a copy/collective (a known zero)."""
    if steps and "plasmient.flops.coverage" in steps[0]:
        busy = np.array([r["plasmient.busy_s"] or 0.0 for r in steps])
        cov = np.array([np.nan if r["plasmient.flops.coverage"] is None else r["plasmient.flops.coverage"] for r in steps])
        ok = ~np.isnan(cov)
        return float((cov[ok] * busy[ok]).sum() / busy[ok].sum()) if busy[ok].sum() > 0 else float("nan")
    kernels = [r for r in rows if r["plasmient.level"] == "kernel"]
    dur = np.array([r["end_ns"] - r["start_ns"] for r in kernels], float)
    known = np.array([(r["plasmient.flops"] or 0) > 0 or r.get("plasmient.kernel.kind") in ("memcpy", "memset", "collective")
                      for r in kernels], bool)
    return float(dur[known].sum() / dur.sum()) if dur.sum() > 0 else float("nan")


if __name__ == "__main__":
    sys.exit(main())
