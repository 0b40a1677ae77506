"""Ingest speed and memory, measured in one run and printed as ratios (these machines are noisy; no asserts).

1. The largest shared traces: plasmient's read (gunzip + typed decode + record tables), + stitch, + JSONL
   export, each against `json.load(gzip.open(file))` of the same file, the floor for any reader that
   builds Python objects. Rounds interleave the two so load on a shared machine hits both alike; the
   ratios printed are medians over rounds. Targets: read + stitch + JSONL <= 1.0x (fail above 1.5x).
   Peak memory: a child process per file reports its RSS growth during ingest + stitch + JSONL (the
   imports excluded), against the decompressed size. Target: <= 2x. Every process uses the Arrow memory
   pool `plasmient ingest` uses (``arrow_memory.use_offline_pool``: the system allocator unless
   ARROW_DEFAULT_MEMORY_POOL is set; set it to mimalloc to measure pyarrow's default, or jemalloc).
2. Throughput at scale: the record tables of a real trace replicated (new steps, shifted times,
   offset correlation/external ids) until there are >= 10^6 kernels, then stitched and encoded to a
   JSONL file, at each of --kernels (default 10^4, 10^5, 10^6), each in its own child process on one core.
   Prints a table: kernels/s stitched, spans/s encoded, and peak RSS (after building the records, after
   the stitch, after the JSONL). Targets: >= 200,000 kernels/s stitched, >= 200,000 spans/s encoded,
   <= 2 GB peak RSS at 10^6 kernels. spans/s is per CPU second of the process, user + system; the last
   columns split it: the JSONL's size, the system seconds (the kernel copying a multi-GB file into the
   page cache and writing it back, which grows with memory pressure at 10^6) and spans per user second
   (the encoding itself).

3. With --pool: the same files read as ranks of one job, in one process and in the local process pool.

    .venv/bin/python benchmarks/bench_ingest.py [--files 3] [--rounds 5] [--skip-largest] [--skip-scale] [--pool]
        [--kernels 10000 100000 1000000] [--scale-rounds 1] [--no-encode] [--base v100/resnet50_training.json.gz]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
sys.path.insert(0, str(REPO))

from plasmient_trace.arrow_memory import use_offline_pool
from plasmient_trace.export import otlp_json
from plasmient_trace.export.page_cache import DropBehindFile
from plasmient_trace.pipeline import IngestOptions, stream_records
from plasmient_trace.records import RecordSet
from plasmient_trace.sources.kineto import read_kineto
from plasmient_trace.sources.parallel import default_workers, read_many
from proc_status import vm_mib


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def largest_traces(count: int) -> list[Path]:
    return sorted(TRACES.rglob("*.json.gz"), key=lambda p: p.stat().st_size, reverse=True)[:count]


def _time_floor(path: Path) -> float:
    t = time.perf_counter()
    with gzip.open(path, "rb") as f:
        json.load(f)
    return time.perf_counter() - t


def _time_plasmient(path: Path, out: Path) -> tuple[float, float, float]:
    """Seconds to (read, read + stitch, read + stitch + JSONL), the stitch and the JSONL interleaved a group
    of steps at a time as `plasmient ingest` runs them (the read + stitch time counts the stitch only)."""
    t = time.perf_counter()
    records = read_kineto(path)
    t_read = time.perf_counter() - t
    stitch_s, write_s = _stream_to(stream_records([records], IngestOptions(job_id="bench")), out)
    return t_read, t_read + stitch_s, t_read + stitch_s + write_s


def _stream_to(stream, out: Path | None, cpu: list[float] | None = None) -> tuple[float, float]:
    """Stitch the stream's parts and write each as JSON lines (none with out=None), letting each go, then
    sync the file, as `plasmient ingest` does: (stitch seconds, write seconds). ``cpu`` gets [stitch CPU
    seconds, write CPU seconds, write system seconds] of the process, each clocked around its own calls."""
    stitch_s = stitch_cpu = 0.0
    written = [0.0, 0.0, 0.0]  # wall, CPU and system seconds of the file's writes, its sync included

    def clocked(write: Callable[[], object]) -> None:
        c, t, k = time.process_time(), time.perf_counter(), os.times().system
        write()
        written[0] += time.perf_counter() - t
        written[1] += time.process_time() - c
        written[2] += os.times().system - k  # the kernel's side of the file writes

    # the file as `plasmient ingest` writes it: its pages leave the page cache two windows behind the end
    f = DropBehindFile(open(out, "wb", buffering=1 << 20)) if out is not None else None  # noqa: SIM115 - optional file
    try:
        parts = iter(stream.parts)
        while True:
            c, t = time.process_time(), time.perf_counter()
            part = next(parts, None)
            stitch_s += time.perf_counter() - t
            stitch_cpu += time.process_time() - c
            if part is None:
                break
            if f is not None:
                clocked(lambda: otlp_json.write_jsonl(part, f))  # noqa: B023 - called at once, in this iteration
            del part
        if f is not None:
            # synced, as `plasmient ingest` syncs its file before renaming it into place: the kernel's writeback
            # of what was written is part of writing it
            clocked(lambda: (f.flush(), os.fsync(f.fileno())))
    finally:
        if f is not None:
            f.close()
    if cpu is not None:
        cpu[:] = [stitch_cpu, written[1], written[2]]
    return stitch_s, written[0]


def _rss_child(path: Path) -> None:
    """Child mode: peak RSS above the post-import RSS, after the read, after the stitch and after the
    JSONL export (MiB). Conservative: a transient peak during the imports would count too."""
    before = vm_mib("VmRSS")
    records = read_kineto(path)
    read_peak = vm_mib("VmHWM") - before
    with tempfile.TemporaryDirectory() as tmp:
        _stream_to(stream_records([records], IngestOptions(job_id="bench")), Path(tmp) / "out.jsonl")
    print(json.dumps({"read_mb": read_peak, "total_mb": vm_mib("VmHWM") - before}))


def bench_files(count: int, rounds: int, out_dir: Path) -> None:
    paths = largest_traces(count)
    ratios: dict[Path, list[tuple[float, float, float]]] = {p: [] for p in paths}
    floors: dict[Path, list[float]] = {p: [] for p in paths}
    for r in range(rounds):
        for path in paths:
            # Alternate which goes first: a noisy neighbour then slows both sides alike over the rounds.
            if r % 2:
                times = _time_plasmient(path, out_dir / "bench.jsonl")
                floor = _time_floor(path)
            else:
                floor = _time_floor(path)
                times = _time_plasmient(path, out_dir / "bench.jsonl")
            floors[path].append(floor)
            ratios[path].append(tuple(t / floor for t in times))
    print(f"real traces, {rounds} interleaved rounds, medians (floor = json.load(gzip.open(file)))")
    print(f"  {'trace':44s} {'MiB json':>8s} {'floor s':>7s} {'read':>6s} {'+stitch':>7s} {'+JSONL':>7s}   "
          f"{'peak RSS growth: read, read + stitch + JSONL (x json size)':40s}")
    for path in paths:
        size = len(gzip.decompress(path.read_bytes())) / 2**20
        proc = subprocess.run([sys.executable, __file__, "--rss-child", str(path)], check=False, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        rss = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}
        rss = {key: rss.get(key, float("nan")) for key in ("read_mb", "total_mb")}
        med = [statistics.median(r[i] for r in ratios[path]) for i in range(3)]
        verdict = "ok" if med[2] <= 1.0 else ("over the 1.0x target" if med[2] <= 1.5 else "FAIL (> 1.5x)")
        print(f"  {str(path.relative_to(TRACES))[:44]:44s} {size:8.1f} {statistics.median(floors[path]):7.3f} "
              f"{med[0]:5.2f}x {med[1]:6.2f}x {med[2]:6.2f}x   {rss['read_mb']:5.0f} MiB ({rss['read_mb'] / size:.1f}x), "
              f"{rss['total_mb']:5.0f} MiB ({rss['total_mb'] / size:.1f}x)   {verdict}")


def bench_pool(count: int, rounds: int) -> None:
    """Multi-rank read: the largest traces as ranks, one process vs the local process pool."""
    paths = largest_traces(count)
    workers = default_workers(len(paths))
    seq, pooled = [], []
    for r in range(rounds):
        for mode in ((0, 1) if r % 2 else (1, 0)):
            t = time.perf_counter()
            read_many(paths, workers=1 if mode == 0 else workers)
            (seq if mode == 0 else pooled).append(time.perf_counter() - t)
    s, p = statistics.median(seq), statistics.median(pooled)
    print(f"multi-rank read of the {len(paths)} largest traces, medians of {rounds} interleaved rounds:")
    print(f"  one process {s:6.2f} s   pool of {workers} workers {p:6.2f} s   speed-up {s / p:.2f}x")


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


def _scale_child(base_name: str, kernels: int, rounds: int, encode: bool) -> None:
    """Child mode: stitch (and encode) one replicated trace on one core, a group of steps at a time as
    `plasmient ingest` does; report CPU times and peak RSS (MiB).

    One process per scale, so each peak is its own (VmHWM); pyarrow's thread pool is cut to one thread."""
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    base = read_kineto(TRACES / base_name)
    copies = -(-kernels // base.kernels.num_rows)
    records = replicate(base, copies)
    del base
    rss_records = vm_mib("VmRSS")
    times, cpu, enc_cpu, enc_sys = [], [], [], []
    stream = None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "scale.jsonl" if encode else None
        for _ in range(rounds):
            c, t = time.process_time(), time.perf_counter()
            stream = stream_records([records], IngestOptions(job_id="bench", max_spans=10**9))
            prepare_cpu = time.process_time() - c  # alignment and FLOP models (the stitch's first steps)
            prepare_wall = time.perf_counter() - t
            split: list[float] = []
            stitch_wall, _ = _stream_to(stream, out, split)
            times.append(prepare_wall + stitch_wall)
            cpu.append(prepare_cpu + split[0])
            enc_cpu.append(split[1])
            enc_sys.append(split[2])
        jsonl_mb = out.stat().st_size / 1e6 if out is not None else None
    result = {"copies": copies, "kernels": records.kernels.num_rows, "ops": records.ops.num_rows,
              "steps": records.steps.num_rows, "spans": stream.stats["spans"], "stitch_s": statistics.median(times),
              "stitch_cpu_s": statistics.median(cpu), "rss_records_mb": rss_records}
    if encode:
        result.update(encode_cpu_s=statistics.median(enc_cpu), encode_sys_s=statistics.median(enc_sys), jsonl_mb=jsonl_mb)
    result["rss_peak_mb"] = vm_mib("VmHWM")
    print(json.dumps(result))


def bench_scale(base_name: str, sizes: list[int], rounds: int, encode: bool) -> None:
    """Stitch throughput and peak RSS from 10^4 to 10^6 kernels, one child process per size."""
    print(f"synthetic: {base_name} replicated (new steps, shifted times and ids); stitch = align + FLOP models + "
          f"joins + tree + metrics + columns, median of {rounds} rounds; one core (pyarrow 1 thread); "
          "RSS = the child's VmHWM, whole process")
    print("  (kernels/s and spans/s are per CPU-second of the process, which a loaded shared machine inflates less "
          "than wall time; wall seconds beside them)")
    print("  (stitched and written a group of steps at a time, as `plasmient ingest` runs: the peak holds the "
          "records and one group's spans)")
    print(f"  {'kernels':>9s} {'ops':>9s} {'spans':>9s} {'stitch s':>8s} {'(wall)':>7s} {'kernels/s':>10s} {'x200k':>6s} "
          f"{'RSS records':>11s} {'JSONL s':>7s} {'spans/s':>9s} {'RSS peak':>8s}  {'JSONL MB':>8s} {'of it sys s':>11s} {'spans/user s':>12s}")
    for n in sizes:
        cmd = [sys.executable, __file__, "--scale-child", str(n), "--base", base_name, "--rounds", str(rounds)]
        if not encode:
            cmd.append("--no-encode")
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        if proc.returncode:
            print(f"  {n:>9,d} failed: {proc.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rate = r["kernels"] / r["stitch_cpu_s"]
        enc = (f"{r['encode_cpu_s']:7.2f} {r['spans'] / r['encode_cpu_s']:9,.0f}" if "encode_cpu_s" in r else f"{'-':>7s} {'-':>9s}")
        print(f"  {r['kernels']:>9,d} {r['ops']:>9,d} {r['spans']:>9,d} {r['stitch_cpu_s']:8.2f} {r['stitch_s']:7.2f} {rate:10,.0f} "
              f"{rate / 2e5:6.2f} {r['rss_records_mb']:7.0f} MiB {enc} "
              f"{r['rss_peak_mb']:5.0f} MiB  " + (f"{r['jsonl_mb']:8,.0f} {r['encode_sys_s']:11.2f} "
              f"{r['spans'] / max(r['encode_cpu_s'] - r['encode_sys_s'], 1e-9):12,.0f}" if "encode_cpu_s" in r else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=3, help="how many of the largest shared traces")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kernels", type=int, nargs="+", default=[10_000, 100_000, 1_000_000],
                        help="scale part: kernel counts to replicate the base trace to")
    parser.add_argument("--scale-rounds", type=int, default=1, help="stitch rounds per scale (median)")
    parser.add_argument("--no-encode", action="store_true", help="scale part: stitch only, no JSONL")
    parser.add_argument("--scale-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--base", default="v100/resnet50_training.json.gz")
    parser.add_argument("--skip-largest", action="store_true")
    parser.add_argument("--skip-scale", action="store_true")
    parser.add_argument("--pool", action="store_true", help="also time the multi-rank read in a process pool")
    parser.add_argument("--rss-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    pool = use_offline_pool()  # as `plasmient ingest` does; ARROW_DEFAULT_MEMORY_POOL=mimalloc measures the default
    if args.rss_child:
        _rss_child(args.rss_child)
        return
    if args.scale_child:
        _scale_child(args.base, args.scale_child, args.rounds, not args.no_encode)
        return
    print(f"one process, {os.cpu_count()} cores visible; numpy/pyarrow single-threaded paths dominate; "
          f"Arrow memory pool: {pool}")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_largest:
            bench_files(args.files, args.rounds, Path(tmp))
        if args.pool:
            bench_pool(args.files, args.rounds)
        if not args.skip_scale:
            bench_scale(args.base, args.kernels, args.scale_rounds, not args.no_encode)


if __name__ == "__main__":
    main()
