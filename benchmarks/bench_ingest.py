"""Ingest speed, measured in one run and printed as ratios (these machines are noisy; no asserts).

1. The largest shared trace: parse (plasmient's reader) + stitch + JSONL export, against plain
   `json.load` of the same decompressed file — the floor for any JSON reader. Target: within 3x.
2. Throughput at scale: the record tables of a real trace replicated (new steps, shifted times,
   offset correlation/external ids) until there are >= 10^6 kernels, then stitched and encoded to a
   JSONL file. Prints kernels/s stitched, spans/s encoded, and peak RSS. Targets: >= 200,000 kernels/s
   stitched, >= 100,000 spans/s encoded, one core.

    .venv/bin/python benchmarks/bench_ingest.py [--kernels 1000000] [--base v100/resnet50_training.json.gz]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
sys.path.insert(0, str(REPO))

from plasmient_trace.export import otlp_json  # noqa: E402
from plasmient_trace.pipeline import IngestOptions, ingest_paths, stitch_records  # noqa: E402
from plasmient_trace.records import RecordSet  # noqa: E402
from plasmient_trace.sources.kineto import read_kineto  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def largest_trace() -> Path:
    return max(TRACES.glob("*/*.json.gz"), key=lambda p: p.stat().st_size)


def bench_largest(out_dir: Path) -> None:
    path = largest_trace()
    raw = gzip.decompress(path.read_bytes())
    t = time.perf_counter()
    json.loads(raw)
    t_json = time.perf_counter() - t
    del raw
    t = time.perf_counter()
    result = ingest_paths([path], IngestOptions(job_id="bench"))
    t_stitch = time.perf_counter() - t
    t = time.perf_counter()
    otlp_json.write_jsonl(result.batch, out_dir / "largest.jsonl")
    t_total = time.perf_counter() - t + t_stitch
    print(f"largest trace: {path.relative_to(TRACES)} ({path.stat().st_size / 1e6:.1f} MB gz)")
    print(f"  gunzip+json.load   {t_json:8.3f} s   (floor)")
    print(f"  ingest+stitch      {t_stitch:8.3f} s")
    print(f"  + JSONL export     {t_total:8.3f} s   ratio to json.load: {t_total / t_json:.2f}x (target <= 3x)")


def _shift(table: pa.Table, columns: dict[str, int]) -> pa.Table:
    for name, delta in columns.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, table.schema.field(i), pc.add(table.column(name), pa.scalar(delta, pa.int64())))
    return table


def replicate(base: RecordSet, copies: int) -> RecordSet:
    span = int(max(base.kernels.column("end_ns").to_numpy().max(), base.ops.column("end_ns").to_numpy().max())
               - min(base.kernels.column("start_ns").to_numpy().min(), base.ops.column("start_ns").to_numpy().min())) + 1_000_000
    corr_span = int(pc.max(base.launches.column("correlation_id")).as_py()) + 1
    ext_span = int(pc.max(base.ops.column("external_id")).as_py() or 0) + 1
    step_span = int(pc.max(base.steps.column("step")).as_py()) + 1 if base.steps.num_rows else 1
    parts = {name: [] for name in ("kernels", "launches", "ops", "modules", "steps")}
    for c in range(copies):
        dt = c * span
        parts["kernels"].append(_shift(base.kernels, {"start_ns": dt, "end_ns": dt, "correlation_id": c * corr_span}))
        parts["launches"].append(_shift(base.launches, {"start_ns": dt, "end_ns": dt, "correlation_id": c * corr_span, "external_id": c * ext_span}))
        parts["ops"].append(_shift(base.ops, {"start_ns": dt, "end_ns": dt, "external_id": c * ext_span}))
        parts["modules"].append(_shift(base.modules, {"start_ns": dt, "end_ns": dt}))
        parts["steps"].append(_shift(base.steps, {"start_ns": dt, "end_ns": dt, "step": c * step_span}))
    out = RecordSet(devices=base.devices, resource=dict(base.resource), source=f"{base.source} x{copies}", clock=base.clock)
    for name, tables in parts.items():
        setattr(out, name, pa.concat_tables(tables).combine_chunks())
    return out


def bench_scale(base_name: str, kernels: int, out_dir: Path) -> None:
    base = read_kineto(TRACES / base_name)
    copies = -(-kernels // base.kernels.num_rows)
    records = replicate(base, copies)
    n_k = records.kernels.num_rows
    print(f"synthetic: {base_name} x{copies}: {n_k:,} kernels, {records.ops.num_rows:,} ops, {records.steps.num_rows:,} steps")
    rss0 = peak_rss_mb()
    t = time.perf_counter()
    result = stitch_records([records], IngestOptions(job_id="bench", max_spans=10**9))
    t_stitch = time.perf_counter() - t
    n_spans = len(result.batch)
    t = time.perf_counter()
    out = out_dir / "scale.jsonl"
    otlp_json.write_jsonl(result.batch, out)
    t_enc = time.perf_counter() - t
    print(f"  stitch (joins+tree+metrics): {t_stitch:7.2f} s  {n_k / t_stitch:12,.0f} kernels/s  ratio to 200k/s: {n_k / t_stitch / 2e5:.2f}")
    print(f"  encode JSONL ({out.stat().st_size / 1e6:.0f} MB): {t_enc:7.2f} s  {n_spans / t_enc:12,.0f} spans/s    ratio to 100k/s: {n_spans / t_enc / 1e5:.2f}")
    print(f"  spans: {n_spans:,}; peak RSS {peak_rss_mb():.0f} MB (before stitch {rss0:.0f} MB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=1_000_000)
    parser.add_argument("--base", default="v100/resnet50_training.json.gz")
    parser.add_argument("--skip-largest", action="store_true")
    args = parser.parse_args()
    print(f"one process, {os.cpu_count()} cores visible; numpy/pyarrow single-threaded paths dominate")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_largest:
            bench_largest(Path(tmp))
        bench_scale(args.base, args.kernels, Path(tmp))


if __name__ == "__main__":
    main()
