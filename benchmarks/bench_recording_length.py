"""How a recording's cost changes with its length: step time and memory per block of steps, for one long
recording of each configuration on the tiny transformer (CPU).

``bench_capture_overhead.py`` compares configurations over rounds of a fixed length; this asks whether a
recording left on costs the same at step 600 as at step 100. Each configuration runs in its own child
process, which warms up, starts recording, times ``--blocks`` consecutive blocks of ``--block`` steps (wall
milliseconds a step, and the process's resident memory after each block) and exits without any processing
at exit (torch.profiler's would take minutes, and only its recording is asked about here):

  plain          uninstrumented (run first and last: the machine's drift shows between them)
  full           plasmient live capture, every step at full depth (the export runs beside the loop; its
                 drain after the last block is printed apart)
  profiler       torch.profiler(activities=[CPU], record_shapes=True), as bench_capture_overhead runs it
                 (FLOP counting needs shapes)
  profiler-noshapes  the same without record_shapes

Ratios are to the median block of the two plain runs.

    python benchmarks/bench_recording_length.py [--blocks 6] [--block 100] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from proc_status import vm_mib

CONFIGS = ("plain", "full", "profiler", "profiler-noshapes")


def run_one(config: str, blocks: int, block: int, threads: int) -> dict:
    """One recording of ``blocks`` x ``block`` steps in this process (the child's job)."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import train_tiny_transformer as tiny

    torch.set_num_threads(threads)
    model, opt, data = tiny.build()
    for _ in range(20):
        tiny.train_step(model, opt, data)
    session = None
    if config == "full":
        from plasmient_trace.capture.session import CaptureConfig, CaptureSession

        out = Path(tempfile.mkdtemp(prefix="plasmient-bench-")) / "full.jsonl"
        env = {"PLASMIENT_EVERY": "1", "PLASMIENT_OVERHEAD": "0"}
        session = CaptureSession(CaptureConfig.from_env(env, job_id="bench", out=str(out))).start()
        tiny.train_step(model, opt, data)  # step 0 (always full depth) opens the run, not timed
        session.flush(60)
    elif config.startswith("profiler"):
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                      record_shapes=config == "profiler")
        prof.__enter__()  # never exited: its processing at exit is not what is measured
    ms, rss = [], []
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(block):
            tiny.train_step(model, opt, data)
        ms.append((time.perf_counter() - t) / block * 1e3)
        rss.append(vm_mib("VmRSS"))
    result = {"config": config, "ms": ms, "rss_mib": rss}
    if session is not None:
        t = time.perf_counter()
        session.flush(600)
        result["drain_s"] = time.perf_counter() - t
        result["steps_deferred"] = session.stats.get("steps_deferred", 0)
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--block", type=int, default=100, help="steps per block")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args.child, args.blocks, args.block, args.threads)), flush=True)
        os._exit(0)  # no profiler processing, no export drain beyond the one timed above
    runs = []
    for config in ("plain", "full", "profiler", "profiler-noshapes", "plain"):
        cmd = [sys.executable, __file__, "--child", config, "--blocks", str(args.blocks),
               "--block", str(args.block), "--threads", str(args.threads)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("{")), None)
        if done.returncode != 0 or line is None:
            print(f"{config}: failed (exit {done.returncode}): {done.stderr.strip()[-500:]}", file=sys.stderr)
            continue
        runs.append(json.loads(line))
    plain = [m for r in runs if r["config"] == "plain" for m in r["ms"]]
    if not plain:
        print("no plain run: nothing to compare with", file=sys.stderr)
        return {"runs": runs}
    base = statistics.median(plain)
    print(f"ratio of each block's step time to the plain median ({base:.1f} ms a step), "
          f"{args.blocks} blocks of {args.block} steps; resident MiB after each block")
    for r in runs:
        ratios = " ".join(f"{m / base:5.2f}" for m in r["ms"])
        rss = " ".join(f"{v:6.0f}" for v in r["rss_mib"])
        extra = f"  (drain after the loop {r['drain_s']:.2f} s, {r['steps_deferred']} put off)" if "drain_s" in r else ""
        print(f"{r['config']:18s} {ratios}   RSS {rss}{extra}")
    return {"base_ms": base, "runs": runs}


if __name__ == "__main__":
    main()
