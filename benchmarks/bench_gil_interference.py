"""What the background stitch and encode cost the training loop: through the GIL, or through the hardware?

Live capture stitches and encodes on a background thread of the training process. On a 2-vCPU machine full
depth every step cost the tiny transformer's loop 1.3-1.4x while the same work's CPU, on the other core,
could not explain it. This runs the example's training loop (one torch thread) beside the same background
work (stitch + JSONL encoding of a real trace's records, repeated at a fixed rate), once with that work
on a thread of the training process and once in a process of its own, interleaved, and prints the loop's
wall time and its thread's CPU as ratios to the loop alone, with how much background work each mode got done.

  .venv/bin/python benchmarks/bench_gil_interference.py [--rounds 3] [--steps 100] [--rate 8]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))

TRACE = "a100_multirank/rank-0.json.gz"  # small: one unit of work is tens of milliseconds, so the rate is fine-grained
MODES = ("alone", "thread", "process")


def background(stop, rate: float, done, cpu_s) -> None:
    """Stitch and encode the trace's records ``rate`` times a second (as many as it can, if fewer), until
    ``stop``; counts the units in ``done`` and this thread's CPU seconds in ``cpu_s``."""
    import pyarrow as pa

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    import bench_ingest

    from plasmient_trace.export.otlp_json import encode_jsonl_lines
    from plasmient_trace.pipeline import IngestOptions, stream_records

    records = bench_ingest.read_kineto(bench_ingest.TRACES / TRACE)
    period = 1.0 / rate
    due = time.perf_counter()
    while not stop.is_set():
        now = time.perf_counter()
        if now < due:
            time.sleep(min(due - now, 0.05))
            continue
        due = max(due + period, now - period)  # a unit late is not made up twice over
        cpu = time.thread_time()
        stream = stream_records([records], IngestOptions(job_id="bench", max_spans=10**9))
        for part in stream.parts:
            for _ in encode_jsonl_lines(part):
                pass
        with done.get_lock():
            done.value += 1
        with cpu_s.get_lock():
            cpu_s.value += time.thread_time() - cpu


def one_round(mode: str, steps: int, rate: float) -> tuple[float, float, float, float]:
    """(loop wall s a step, training thread CPU s a step, background units a second, background CPU share)."""
    import train_tiny_transformer as tiny

    model, opt, data = tiny.build()
    for _ in range(3):
        tiny.train_step(model, opt, data)
    ctx = mp.get_context("spawn")  # a process of its own: no torch state shared with the loop
    stop, done, cpu_s = ctx.Event(), ctx.Value("i", 0), ctx.Value("d", 0.0)
    worker: threading.Thread | mp.process.BaseProcess | None = None
    if mode == "thread":
        worker = threading.Thread(target=background, args=(stop, rate, done, cpu_s), daemon=True)
    elif mode == "process":
        worker = ctx.Process(target=background, args=(stop, rate, done, cpu_s))
    if worker is not None:
        worker.start()
        while done.value < 2:  # imports and the trace's read are not in the clock
            time.sleep(0.05)
    units0, cpu0 = done.value, cpu_s.value
    wall0, thread0 = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        tiny.train_step(model, opt, data)
    wall, thread = time.perf_counter() - wall0, time.thread_time() - thread0
    units, background_cpu = done.value - units0, cpu_s.value - cpu0
    stop.set()
    if worker is not None:
        worker.join(60)
    return wall / steps, thread / steps, units / wall, background_cpu / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rate", type=float, default=8.0, help="background units (stitch + encode of the trace) a second")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    results: dict[str, list[tuple[float, float, float, float]]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            results[mode].append(one_round(mode, args.steps, args.rate))
            print(f"round {r + 1} {mode}: {results[mode][-1][0] * 1e3:.2f} ms a step", file=sys.stderr)
    base_wall = statistics.median(x[0] for x in results["alone"])
    base_cpu = statistics.median(x[1] for x in results["alone"])
    print(f"{args.rounds} rounds of {args.steps} steps, median; background asked for {args.rate:g} units a second "
          f"(stitch + JSONL of {TRACE})")
    print("| background work | loop wall | training thread CPU | units done a second | its CPU, share of a core |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        rows = results[mode]
        wall = statistics.median(x[0] for x in rows)
        cpu = statistics.median(x[1] for x in rows)
        units = statistics.median(x[2] for x in rows)
        share = statistics.median(x[3] for x in rows)
        where = {"alone": "none", "thread": "a thread of the training process", "process": "a process of its own"}[mode]
        print(f"| {where} | {wall / base_wall:.3f} ({wall * 1e3:.1f} ms) | {cpu / base_cpu:.3f} | {units:.2f} | {share:.2f} |")


if __name__ == "__main__":
    main()
