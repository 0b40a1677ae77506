"""`plasmient ingest` end to end on a large file: peak RSS and wall time of the command a user runs.

bench_ingest.py's scale table starts from record tables replicated in memory, so it leaves out the
parse. Here a real trace is replicated at the JSON level instead (each copy shifted in time, its
correlation and External ids and step numbers offset), written as one gzip'd Kineto file of about
--kernels kernels, and `plasmient ingest FILE --out OUT --quiet` runs in a child process. Printed: the
file's sizes, the child's wall time and peak RSS (ru_maxrss), the spans and bytes it wrote. Target
(issue 12): <= 2 GB peak RSS at 10^6 kernels. Needs about 40 MB of disk per 10^4 kernels (the JSONL).

With ``--report``, `plasmient report OUT --html PAGE --quiet` then reads the spans back in a child: its
wall time, spans a second and peak RSS, and its wall time as a ratio to the floor of any Python reader of
these lines (``orjson.loads`` of every line, the cyclic GC paused, in this process; the floor is timed
before and after the report and the faster kept).

    .venv/bin/python benchmarks/bench_ingest_file.py [--kernels 1000000] [--base v100/resnet50_training.json.gz] [--report]
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
_STEP = re.compile(r"ProfilerStep#(\d+)$")


def _spans(events: list[dict]) -> tuple[float, int, int, int]:
    """(time span in µs, correlation id span, External id span, step number span) of one copy."""
    timed = [e for e in events if isinstance(e.get("ts"), (int, float))]
    t0 = min(e["ts"] for e in timed)
    t1 = max(e["ts"] + (e.get("dur") or 0) for e in timed)
    ids = {"correlation": 0, "External id": 0, "external id": 0}
    for e in events:
        args = e.get("args")
        if isinstance(args, dict):
            for k, seen in ids.items():
                if isinstance(args.get(k), int):
                    ids[k] = max(seen, args[k])
    steps = [int(m.group(1)) for e in events if (m := _STEP.match(str(e.get("name", ""))))]
    return t1 - t0 + 1000.0, ids["correlation"] + 1, max(ids["External id"], ids["external id"]) + 1, max(steps, default=0) + 1


def write_replicated(base: Path, kernels: int, out: Path) -> tuple[int, int]:
    """The base trace's events copied until there are >= kernels kernels; returns (copies, kernels)."""
    doc = json.loads(gzip.decompress(base.read_bytes()))
    events = doc["traceEvents"]
    per_copy = sum(1 for e in events if str(e.get("cat", "")).lower() == "kernel")
    copies = -(-kernels // per_copy)
    dt, dcorr, dext, dstep = _spans(events)
    head = {k: v for k, v in doc.items() if k != "traceEvents"}
    with gzip.open(out, "wb", compresslevel=1) as f:
        f.write(b'{"traceEvents": [')
        for c in range(copies):
            shifted = []
            for e in events:
                e = dict(e)
                if isinstance(e.get("ts"), (int, float)):
                    e["ts"] += c * dt
                if isinstance(e.get("args"), dict):
                    e["args"] = args = dict(e["args"])
                    for key, delta in (("correlation", dcorr), ("External id", dext), ("external id", dext)):
                        if isinstance(args.get(key), int) and args[key] > 0:
                            args[key] += c * delta
                if m := _STEP.match(str(e.get("name", ""))):
                    e["name"] = f"ProfilerStep#{int(m.group(1)) + c * dstep}"
                shifted.append(e)
            f.write((b"," if c else b"") + json.dumps(shifted)[1:-1].encode())
        f.write(b"], " + json.dumps(head)[1:].encode())
    return copies, copies * per_copy


def run_child(args: list[str]) -> tuple[float, float]:
    """(wall s, peak RSS MiB) of one child command; exits with its stderr if it fails."""
    t = time.perf_counter()
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    stderr = proc.stderr.read() if proc.stderr else b""
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not the max over every child
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t
    if proc.returncode:
        sys.exit(f"{' '.join(args[2:4])} failed ({proc.returncode}): {stderr.decode(errors='replace').strip()[-500:]}")
    return wall, usage.ru_maxrss / 1024


def parse_floor(path: Path) -> float:
    """Seconds to orjson.loads every line of a span file, the cyclic GC paused (as plasmient's reader does)."""
    gc.disable()
    try:
        t = time.perf_counter()
        with open(path, "rb") as f:
            for line in f:
                orjson.loads(line)
        return time.perf_counter() - t
    finally:
        gc.enable()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", type=int, default=1_000_000)
    p.add_argument("--base", default="v100/resnet50_training.json.gz")
    p.add_argument("--report", action="store_true", help="then time `plasmient report --html` on the spans written")
    args = p.parse_args()
    cli = [sys.executable, "-m", "plasmient_trace.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        trace, out = Path(tmp) / "replicated.json.gz", Path(tmp) / "out.jsonl"
        t = time.perf_counter()
        copies, kernels = write_replicated(TRACES / args.base, args.kernels, trace)
        print(f"{args.base} x{copies}: {kernels:,} kernels, {trace.stat().st_size / 1e6:,.0f} MB gzip "
              f"(written in {time.perf_counter() - t:.0f} s)")
        wall, peak_mib = run_child([*cli, "ingest", str(trace), "--out", str(out), "--quiet"])
        with open(out, "rb") as f:
            lines = sum(1 for _ in f)
        print(f"plasmient ingest: {wall:.0f} s wall, peak RSS {peak_mib:,.0f} MiB "
              f"({'within' if peak_mib * 2**20 <= 2e9 else 'over'} the 2 GB target), "
              f"{lines:,} traces, {out.stat().st_size / 1e9:.1f} GB of JSONL")
        if args.report:
            trace.unlink()
            floor = parse_floor(out)
            wall, peak_mib = run_child([*cli, "report", str(out), "--html", str(Path(tmp) / "page.html"), "--quiet"])
            floor = min(floor, parse_floor(out))
            with open(out, "rb") as f:
                spans = sum(line.count(b'"spanId"') for line in f)
            print(f"plasmient report --html: {wall:.1f} s wall ({wall / floor:.2f}x orjson.loads of every line, "
                  f"{floor:.1f} s), {spans / wall / 1e3:,.0f}k spans/s, peak RSS {peak_mib:,.0f} MiB "
                  f"({peak_mib * 2**20 / out.stat().st_size:.2f}x the JSONL)")


if __name__ == "__main__":
    main()
