"""Meta's HolisticTraceAnalysis (HTA 0.5.0) as an independent oracle, run on one shared trace in its own Python.

HTA needs pandas and plotly, which plasmient does not, so it lives in its own venv: ``scripts/test.sh`` makes
``.venv-hta`` and names it in ``PLASMIENT_HTA_PYTHON``; a bare ``pytest`` without it skips these checks and
says why. HTA runs with the last ProfilerStep kept (``include_last_profiler_step=True``: plasmient keeps every
step) and its rounding of ns timestamps to whole µs off (``HTA_DISABLE_NS_ROUNDING=1``), so its numbers and
plasmient's come from the same events at the same resolution. docs/hta-tracelens.md compares the definitions.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile

import pytest
from conftest import trace_path

HTA_PYTHON = os.environ.get("PLASMIENT_HTA_PYTHON")
needs_hta = pytest.mark.skipif(
    not HTA_PYTHON, reason="HTA (HolisticTraceAnalysis 0.5.0 with pandas and plotly) lives in its own venv: run "
                           "bash scripts/test.sh, or name a Python that has it in PLASMIENT_HTA_PYTHON")

# One HTA run per trace: its temporal breakdown, its GPU activities per ProfilerStep and per name, and
# its communication/computation overlap.
_SCRIPT = """
import json, logging, sys, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.CRITICAL)
from hta.trace_analysis import TraceAnalysis
t = TraceAnalysis(trace_dir=sys.argv[1], include_last_profiler_step=True)
row = t.get_temporal_breakdown(visualize=False).iloc[0]
out = {"idle_us": float(row["idle_time(us)"]), "compute_us": float(row["compute_time(us)"]),
       "non_compute_us": float(row["non_compute_time(us)"]), "kernel_time_us": float(row["kernel_time(us)"])}
# HTA's own parse: every GPU activity's ProfilerStep ("iteration", -1 for none) and duration (µs)
events = next(iter(t.t.traces.values()))
names = t.t.symbol_table.get_sym_table()
category = events["cat"].map(lambda c: names[c])
acts = events[events["stream"].ne(-1) & category.isin(["kernel", "Kernel", "gpu_memcpy", "Memcpy", "gpu_memset", "Memset"])]
by_step = acts.groupby("iteration")["dur"].agg(["count", "sum"])
out["per_step"] = {str(int(i)): [int(r["count"]), float(r["sum"])] for i, r in by_step.iterrows()}
by_name = acts.assign(kernel=acts["name"].map(lambda c: names[c])).groupby("kernel")["dur"].agg(["count", "sum"])
out["per_name"] = {str(k): [int(r["count"]), float(r["sum"])] for k, r in by_name.iterrows()}
try:
    out["overlap_pct"] = float(t.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"].iloc[0])
except Exception as err:
    out["overlap_error"] = f"{type(err).__name__}: {err}"
print("HTA " + json.dumps(out))
"""


@functools.lru_cache(maxsize=None)
def hta_analysis(name: str) -> dict:
    """HTA's numbers for the shared trace ``name`` (µs and %), as HTA prints them."""
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(trace_path(name), os.path.join(tmp, "rank-0.json.gz"))
        proc = subprocess.run([HTA_PYTHON, "-c", _SCRIPT, tmp], env={**os.environ, "HTA_DISABLE_NS_ROUNDING": "1"},
                              check=False, capture_output=True, text=True, timeout=600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("HTA ")), None)
    if line is None:
        raise AssertionError(f"HTA did not analyse {name} (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(line[4:])
