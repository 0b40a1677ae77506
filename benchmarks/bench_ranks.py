"""Many ranks in parallel: throughput and memory of the multi-rank ingest against one process.

    .venv/bin/python benchmarks/bench_ranks.py [--ranks 64] [--rounds 3] [--workers 1,2,4] [--ray]

Makes ``--ranks`` simulated ranks from the shared a100_multirank traces (benchmarks/simulated_ranks.py: own
rank ids, a host clock shifted by up to 5 ms, per-kernel jitter), then ingests them with each engine:
``workers=1`` is the single-process pipeline (parse, align, stitch, fleet in one process), ``workers=N`` the
map/reduce of plasmient_trace.ranks on a process pool of N, ``ray`` the same tasks on a local Ray of 2
CPUs (started before the clock starts; its start time is shown apart). Each run is a fresh child process,
so its peak RSS (VmHWM) is its own; configurations are interleaved round by round and the median is shown.
CPU seconds (the parent's, and the workers' as each reports after its last task) measure the work done
whatever else the machine runs; wall time shows what that work became on this machine.
Every run's span table (sorted, ids and resources included) is hashed and compared with the single-process
run: "same" must say yes.

``--spill-cost`` instead times, per shared trace, what the process pool pays to keep a rank's records
between its two maps (pickle to a file and back) against parsing the trace again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from proc_status import vm_kib  # noqa: E402


def trace_hash(result) -> str:
    import pyarrow as pa

    table = result.batch.table
    resources = [json.dumps(r, sort_keys=True) for r in result.batch.resources]
    table = table.append_column("resource", pa.array([resources[i] for i in table.column("resource_index").to_pylist()]))
    table = table.drop_columns(["resource_index"]).sort_by([("trace_id", "ascending"), ("span_id", "ascending")])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table.combine_chunks())
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()[:16]


def child(config: str, trace_dir: Path) -> dict:
    """One ingest of every rank in trace_dir, in this (fresh) process."""
    from plasmient_trace.arrow_memory import use_offline_pool
    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    use_offline_pool()  # as `plasmient ingest` does (its pool workers too)
    paths = sorted(trace_dir.glob("rank-*.json.gz"), key=lambda p: int(p.name.split("-")[1].split(".")[0]))
    options = IngestOptions(job_id="bench", keep_records=False)
    engine_start_s = 0.0
    if config == "ray":
        import ray

        t = time.perf_counter()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        engine_start_s = time.perf_counter() - t
        options.ray = ""
    else:
        options.workers = int(config)
    before = vm_kib("VmHWM") or 0
    t, cpu = time.perf_counter(), time.process_time()
    result = ingest_paths(paths, options)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    out = {"config": config, "wall_s": wall, "parent_cpu_s": cpu, "worker_cpu_s": result.stats.get("worker_cpu_s", 0.0), "engine_start_s": engine_start_s, "ranks": len(paths),
           "spans": len(result.batch), "parent_hwm_kib": vm_kib("VmHWM") or 0, "parent_hwm_before_kib": before,
           "worker_hwm_kib": sorted(result.stats.get("worker_peak_rss_kib", {}).values()),
           "hash": trace_hash(result)}
    if config == "ray":
        import ray

        ray.shutdown()
    return out


def spill_cost() -> None:
    import pickle

    from simulated_ranks import TRACES

    from plasmient_trace.sources.kineto import read_kineto

    print("| trace | parse s | pickle + unpickle s | ratio | pickled MB |\n|---|---|---|---|---|")
    for name in ("a100_multirank/rank-0.json.gz", "a100/nccl_training_rank0_of2.json.gz",
                 "b200/eager_rank0_of8.json.gz", "v100/resnet50_training.json.gz"):
        parse, spill = [], []
        for _ in range(3):
            t = time.perf_counter()
            records = read_kineto(TRACES / name)
            parse.append(time.perf_counter() - t)
            with tempfile.TemporaryFile() as f:
                t = time.perf_counter()
                pickle.dump(records, f, protocol=pickle.HIGHEST_PROTOCOL)
                size = f.tell()
                f.seek(0)
                pickle.load(f)
                spill.append(time.perf_counter() - t)
        p, s = statistics.median(parse), statistics.median(spill)
        print(f"| {name} | {p:.3f} | {s:.4f} | {s / p:.1%} | {size / 1e6:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", default="1,2,4", help="comma-separated pool sizes (1 = single process)")
    ap.add_argument("--ray", action="store_true", help="also run on a local Ray of 2 CPUs")
    ap.add_argument("--dir", help="where the simulated ranks are written (default: a temporary directory)")
    ap.add_argument("--spill-cost", action="store_true", help="time pickling a rank's records against re-parsing")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.spill_cost:
        spill_cost()
        return
    if args.child:
        print(json.dumps(child(args.child, Path(args.dir))))
        return

    from simulated_ranks import write_simulated_ranks

    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="plasmient-bench-ranks-")
    trace_dir = Path(args.dir or tmp.name)
    if len(list(trace_dir.glob("rank-*.json.gz"))) != args.ranks:
        t = time.perf_counter()
        write_simulated_ranks(trace_dir, args.ranks)
        print(f"wrote {args.ranks} simulated ranks to {trace_dir} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    configs = [c.strip() for c in args.workers.split(",") if c.strip()]
    if "1" not in configs:
        configs.insert(0, "1")  # the reference every other run must equal
    if args.ray:
        configs.append("ray")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for config in order:
            proc = subprocess.run([sys.executable, __file__, "--child", config, "--dir", str(trace_dir)],
                                  capture_output=True, text=True, env=env, check=False)
            if proc.returncode:
                sys.exit(f"{config}: {proc.stderr.strip().splitlines()[-1:]}")
            runs[config].append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {config}: {runs[config][-1]['wall_s']:.2f} s", file=sys.stderr)
    ref_hash = runs["1"][0]["hash"]
    base = statistics.median(x["wall_s"] for x in runs["1"])
    print(f"\n{args.ranks} ranks, {runs['1'][0]['spans']} spans, {os.cpu_count()} CPUs, median of {args.rounds} "
          "interleaved rounds\n")
    print("| engine | wall s | ranks/s | speed-up | CPU s: parent + workers | parent peak RSS MiB "
          "| worker peak RSS MiB (largest) | same trace as 1 process |")
    print("|---|---|---|---|---|---|---|---|")
    for config in configs:
        xs = runs[config]
        wall = statistics.median(x["wall_s"] for x in xs)
        parent_cpu = statistics.median(x["parent_cpu_s"] for x in xs)
        worker_cpu = statistics.median(x["worker_cpu_s"] for x in xs)
        parent = statistics.median(x["parent_hwm_kib"] for x in xs) / 1024
        workers = [max(x["worker_hwm_kib"]) / 1024 for x in xs if x["worker_hwm_kib"]]
        same = all(x["hash"] == ref_hash for x in xs)
        name = "1 process" if config == "1" else ("Ray, 2 CPUs" if config == "ray" else f"pool, {config} workers")
        if config == "ray":
            name += f" (+{statistics.median(x['engine_start_s'] for x in xs):.1f} s Ray start)"
        print(f"| {name} | {wall:.2f} | {args.ranks / wall:.1f} | {base / wall:.2f}x | "
              f"{parent_cpu:.2f} + {worker_cpu:.2f} | {parent:.0f} | "
              f"{f'{statistics.median(workers):.0f}' if workers else '-'} | {'yes' if same else 'NO'} |")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
