"""First-run check of live capture on a CUDA machine (``scripts/gpu-check.sh`` runs it; < 8 minutes).

For each workload (the tiny transformer training on the GPU, in fp32 and under bf16 autocast; a
decode loop and a large GEMM as explicit inference steps), each in its own child process so CUPTI state never leaks between runs
and one crash cannot hide the other results:

1. ``profiler``: the steps under torch.profiler, its trace exported and ingested (the oracle);
2. ``native``, ``dispatch``, ``kineto``: the same steps (same seed, same inputs) under live capture at
   full depth with each op recorder (the C++ observer, the Python dispatch hook) and with the
   torch.profiler fallback instead of cupti-python, stitched in this process (in-memory exporter);
   ``process``: the native recorder writing a file, as a user runs it, so the batch process stitches
   what the job's side parsed from CUPTI (``PLASMIENT_WORKER=process``, the default);
3. compares, step by step, which op each kernel joined to: the multisets of (parent op, kernel)
   pairs must equal the profiler's (the dispatch hook, a fallback that sees composite ops only from
   outside and makes autograd accumulate out of place, is reported but does not fail the check);
4. runs the examples under ``plasmient run`` on the GPU, as a user would: exit status, every step
   in the file, MFU and util on every step span;
5. records fixtures for tests that need no GPU (``tests/fixtures/gpu/<workload>/``, read by
   tests/test_gpu_fixtures.py): the raw CUPTI activity buffers and the op, module and step tables of
   the ``native`` run, the profiler's trace, every run's joins; and prints a one-screen report. Exit 0 when every join agreed and the examples passed.

Without CUDA it says SKIPPED and exits 0. ``--device cpu`` runs the same plumbing on the CPU (no
kernels, so no join is checked) to catch mistakes before a GPU is at hand.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples"))

VARIANTS = ("profiler", "native", "process", "dispatch", "kineto")
WORKLOADS = ("tiny_transformer", "decode_gemm", "bf16_autocast")


def _workload(name: str, device: str) -> Callable[[], None]:
    """One step's function (an optimizer step, or an explicit capture.step()), built from seed 0."""
    import torch

    if name in ("tiny_transformer", "bf16_autocast"):
        import train_tiny_transformer as tt

        model, opt, data = tt.build(dim=256, layers=2, batch=16, seed=0)
        model, data = model.to(device), data.to(device)
        # bf16_autocast: the same training step with its matmuls in bf16 (the dtype the peak comes from)
        autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=name == "bf16_autocast")

        def train() -> None:
            # the example's train_step without its loss.item(): that copy would fall after optimizer.step(),
            # the live step boundary, but inside the profiler's step, and the two would differ by it
            with autocast:
                logits = model(data[:, :-1])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), data[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()

        return train
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(2048, 2048, bias=False) for _ in range(4)).to(device).eval()
    a = torch.randn(4096, 4096, device=device)
    b = torch.randn(4096, 4096, device=device)
    tokens = torch.randn(8, 1, 2048, device=device)

    def decode_gemm() -> None:
        from plasmient_trace import capture

        with torch.no_grad(), capture.step():
            for t in range(tokens.shape[0]):
                x = tokens[t]
                for layer in layers:
                    x = layer(x)
            torch.mm(a, b)
            if device == "cuda":
                torch.cuda.synchronize()

    return decode_gemm


def _joins(table: Any) -> list[list[Any]]:
    """[step, parent span name, kernel name, count] over the kernel-level spans, sorted."""
    rows = table.select(["span_id", "parent_span_id", "name", "plasmient.level", "plasmient.step"]).to_pylist()
    name_of = {r["span_id"]: r["name"] for r in rows}
    counts = Counter((r["plasmient.step"], name_of.get(r["parent_span_id"], "?"), r["name"])
                     for r in rows if r["plasmient.level"] == "kernel")
    return sorted([s, p, k, n] for (s, p, k), n in counts.items())


def _op_chains(table: Any) -> list[list[Any]]:
    """[step, kernel name, [enclosing op names, innermost first]] per kernel-level span."""
    rows = table.select(["span_id", "parent_span_id", "name", "plasmient.level", "plasmient.step"]).to_pylist()
    by_id = {r["span_id"]: r for r in rows}
    out = []
    for r in rows:
        if r["plasmient.level"] != "kernel":
            continue
        chain, parent = [], by_id.get(r["parent_span_id"])
        while parent is not None and parent["plasmient.level"] == "op":
            chain.append(parent["name"])
            parent = by_id.get(parent["parent_span_id"])
        out.append([r["plasmient.step"], r["name"], chain])
    return out


def _step_rows(table: Any) -> list[dict[str, Any]]:
    cols = [c for c in ("plasmient.step", "plasmient.mfu", "plasmient.util.resident", "plasmient.util.nvml",
                        "plasmient.flops", "plasmient.flops.source", "plasmient.wall_s") if c in table.column_names]
    return [r for r in table.select(cols + ["plasmient.level"]).to_pylist() if r["plasmient.level"] == "step"]


def _save_records(records: Any, directory: Path) -> None:
    """A RecordSet as one Arrow IPC file per table plus its metadata (tests rebuild it from these)."""
    import dataclasses

    import pyarrow as pa

    directory.mkdir(parents=True, exist_ok=True)
    for name, table in records.tables().items():
        if name in ("kernels", "launches", "external_correlation"):
            continue  # parsed from the raw CUPTI buffers, which are saved beside these
        with pa.OSFile(str(directory / f"{name}.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
            w.write_table(table)
    meta = {"devices": [dataclasses.asdict(d) for d in records.devices], "resource": records.resource,
            "source": records.source, "clock": records.clock, "counters": records.counters}
    (directory / "meta.json").write_text(json.dumps(meta, indent=1, default=str))


def _child_profiler(name: str, device: str, steps: int, work: Path) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile, record_function

    from plasmient_trace.pipeline import IngestOptions, ingest_paths

    step = _workload(name, device)
    step()  # warm-up (cuBLAS handles, allocator) outside the profiled steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for k in range(steps):
            # The annotation prof.step() writes only under a schedule: the step boundaries ingest reads.
            with record_function(f"ProfilerStep#{k}"):
                step()
    path = work / "profiler.json"
    prof.export_chrome_trace(str(path))
    with open(path, "rb") as src, gzip.open(work / "profiler.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    table = ingest_paths([path], IngestOptions(job_id="gpu-check-profiler")).batch.table
    return {"joins": _joins(table), "steps": _step_rows(table), "chains": _op_chains(table)}


def _child_capture(name: str, device: str, steps: int, work: Path, variant: str) -> dict[str, Any]:
    import pyarrow as pa

    from plasmient_trace import capture
    from plasmient_trace.capture import batches, cupti, cupti_records
    from plasmient_trace.capture.session import CaptureConfig

    buffers: list[dict] = []
    record_sets: list[Any] = []
    flush, record_set = cupti.CuptiCollector.flush, batches.record_set

    def recording_flush(self: Any) -> Any:
        raw = flush(self)
        buffers.append((raw, self.epoch_offset_ns, cupti_records.name_table(raw)))  # while CUPTI holds them
        return raw

    def recording_record_set(session: Any, items: Any) -> Any:
        rs = record_set(session, items)
        record_sets.append(rs)
        return rs

    cupti.CuptiCollector.flush = recording_flush
    batches.record_set = recording_record_set
    spans: list[Any] = []
    step = _workload(name, device)
    step()
    config = CaptureConfig.from_env(every=1, job_id=f"gpu-check-{name}", flush_timeout_s=120.0,
                                    op_hook="dispatch" if variant == "dispatch" else "native",
                                    kineto=variant == "kineto")
    config.overhead = None  # every step at full depth, whatever its cost
    out = work / "capture.jsonl"
    if variant == "process":
        # as a user runs it: a file, no exporter in this process, so the batch process stitches and writes
        work.mkdir(parents=True, exist_ok=True)
        config.out, config.worker = str(out), "process"
        session = capture.start(config)
    else:
        session = capture.start(config, exporters=[("memory", spans.append)])
    if session is None:
        raise RuntimeError("live capture did not start")
    for _ in range(steps):
        step()
    info = {"on_gpu": bool(session.sources.on_gpu), "source": session.sources.label(), "op_recorder": type(session.sources.ops).__name__,
            "cupti": None if session.sources.cupti is None else (session.sources.cupti.available or session.sources.cupti.reason or False)}
    capture.stop(timeout=120)
    info["stats"] = dict(session.stats)
    if variant == "process":
        from plasmient_trace.export.otlp_json import read_jsonl

        if not info["stats"]["batches_in_child"]:
            raise RuntimeError(f"the batch process stitched no batch (stats {info['stats']})")
        table = read_jsonl(str(out)).table
        return {"joins": _joins(table), "steps": _step_rows(table), **info}
    tables = [b.table for b in spans if len(b)]
    if not tables:
        raise RuntimeError("the capture produced no spans")
    table = pa.concat_tables(tables, promote_options="default")
    if variant == "native":
        raw = work / "cupti"
        raw.mkdir(parents=True, exist_ok=True)
        for k, (buf, offset, names) in enumerate(buffers):
            import numpy as np

            # one file per worker flush (once per export batch; the first fixtures had one per step)
            np.savez_compressed(raw / f"flush{k}.npz", *buf.buffers)
            (raw / f"flush{k}.json").write_text(json.dumps({
                "sizes": {str(kind): size for kind, size in buf.sizes.items()},
                "epoch_offset_ns": offset, "names": {str(p): n for p, n in names.items()}}, indent=1))
        merged = record_sets[0]
        if len(record_sets) > 1:  # several export batches: one RecordSet of every step
            for tname in merged.tables():
                setattr(merged, tname, pa.concat_tables([getattr(r, tname) for r in record_sets], promote_options="default"))
        _save_records(merged, work / "records")
    return {"joins": _joins(table), "steps": _step_rows(table), **info}


def child(args: argparse.Namespace) -> int:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.variant == "profiler":
        result = _child_profiler(args.workload, args.device, args.steps, work)
    else:
        result = _child_capture(args.workload, args.device, args.steps, work, args.variant)
    (work / "result.json").write_text(json.dumps(result, default=str))
    return 0


# ---------------------------------------------------------------------------------------------- parent


def _child_env(**extra: str) -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (what was there stays: carried wheels)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self, most: float) -> float:
        return max(1.0, min(most, self.deadline - time.monotonic()))


def _run(cmd: list[str], timeout: float, env: dict[str, str] | None = None, log: Path | None = None) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired as err:
        if log is not None:  # what it printed before the cut is the only clue to where the time went
            log.write_text("".join(x.decode(errors="replace") if isinstance(x, bytes) else x
                                   for x in (err.stdout or "", err.stderr or "")))
        return 124, f"timed out after {timeout:.0f}s"
    if log is not None:
        log.write_text(p.stdout + p.stderr)
    tail = (p.stderr or p.stdout).strip().splitlines()
    return p.returncode, tail[-1] if tail else ""


def _compare(mine: list[list[Any]], prof: list[list[Any]]) -> tuple[int, int, list[tuple[str, str]]]:
    """(kernels, kernels joined as the profiler joined them, differing pairs); steps paired in order."""
    def by_step(rows: list[list[Any]]) -> list[Counter]:
        out: dict[Any, Counter] = {}
        for s, p, k, n in rows:
            out.setdefault(s, Counter())[(p, k)] += n
        return [out[s] for s in sorted(out)]

    a, b = by_step(mine), by_step(prof)
    kernels = sum(sum(c.values()) for c in a)
    agree = sum(sum((x & y).values()) for x, y in zip(a, b))
    differ = [pk for x, y in zip(a, b) for pk in ((x - y) + (y - x))]
    if len(a) != len(b):
        differ.append(("<steps>", f"{len(a)} live steps vs {len(b)} profiled"))
    return kernels, agree, differ


def _within_chain(mine: list[list[Any]], chains: list[list[Any]]) -> int:
    """Kernels whose op is the profiler's op or one enclosing it: the dispatch hook sees only the
    outermost aten op below autograd (a composite's inner calls do not pass through Python)."""
    steps = sorted({c[0] for c in chains})
    pool: dict[tuple[int, str], list[list[str]]] = {}
    for s, kernel, chain in chains:
        pool.setdefault((steps.index(s), kernel), []).append(chain)
    mine_steps = sorted({r[0] for r in mine})
    agree = 0
    for s, parent, kernel, n in mine:
        candidates = pool.get((mine_steps.index(s), kernel), [])
        for _ in range(n):
            hit = next((i for i, chain in enumerate(candidates) if parent in chain), None)
            if hit is None:
                break
            candidates.pop(hit)
            agree += 1
    return agree


def _fmt(values: list[Any], spec: str) -> str:
    return "[" + ", ".join("-" if v is None else format(v, spec) for v in values) + "]"


def _example(py: str, work: Path, logs: Path, budget: Budget, label: str, script: list[str],
             device: str) -> tuple[bool, list[str]]:
    """An example under ``plasmient run`` as a user runs it: exit 0, its steps in the file, MFU on each."""
    import pyarrow.compute as pc

    from plasmient_trace.export.otlp_json import read_jsonl

    out = work / f"{label}.jsonl"
    env = _child_env()
    cmd = [py, "-m", "plasmient_trace.cli", "run", "--out", str(out), "--", py, *script, "--device", device]
    rc, last = _run(cmd, budget.left(150), env, log=logs / f"{label}.log")
    if rc != 0 or not out.exists():
        return False, [f"  {label}: FAILED: exit {rc}: {last}"]
    table = read_jsonl(str(out)).table
    steps = table.filter(pc.equal(table.column("plasmient.level"), "step")).sort_by("plasmient.step")
    kernels = int(pc.sum(pc.equal(table.column("plasmient.level"), "kernel")).as_py() or 0)
    mfu = steps.column("plasmient.mfu").to_pylist()
    source = Counter(steps.column("plasmient.flops.source").to_pylist()) if "plasmient.flops.source" in steps.column_names else {}
    util = steps.column("plasmient.util.resident").to_pylist() if "plasmient.util.resident" in steps.column_names else []
    sources = steps.column("plasmient.flops.source").to_pylist() if source else [None] * steps.num_rows
    # Unknown is an honest answer (a step with no module forward has no shape signature to carry FLOPs
    # by); an MFU without FLOPs, or FLOPs without an MFU, is not.
    # Step-depth steps record kernels without their launches (PLASMIENT_CUPTI_API): device work on every
    # step, and the full steps after them still join their kernels to ops.
    depth = steps.column("plasmient.sampled_depth").to_pylist()
    per_step = steps.column("plasmient.kernels").to_pylist()
    unjoined = steps.column("plasmient.unjoined_kernels").to_pylist()
    kernels_each = device != "cuda" or all((k or 0) > 0 for k in per_step)
    ok = (steps.num_rows > 0 and source.get("measured", 0) > 0 and (kernels > 0 or device != "cuda") and kernels_each
          and all(s in ("measured", "carried", "unknown") and (m is None) == (s == "unknown") for s, m in zip(sources, mfu)))
    lines = [f"  {label}: {steps.num_rows} steps, {kernels} kernel spans, flops.source {dict(source)} "
             f"({'OK' if ok else 'FAILED: MFU, FLOPs source or kernels missing'})",
             f"    MFU {_fmt(mfu, '.3f')}", f"    resident util {_fmt(util, '.2f')}",
             "    kernels (unjoined) per step: " + " ".join(f"{d[0]}:{k}({u})" for d, k, u in zip(depth, per_step, unjoined))]
    return ok, lines


# (label, bench arguments): the example's tiny model, where a fixed per-step cost shows most, and GPT-2
# small's shape at a batch a GPU trains with
OVERHEAD_RUNS = (("tiny", ["--model", "tiny"]), ("gpt2", ["--model", "gpt2", "--batch", "8", "--seq", "256"]))
OVERHEAD_CONFIGS = "step-level,step-level+api,sampled,full,full+thread,profiler"


def _overhead(py: str, logs: Path, budget: Budget, device: str) -> list[str]:
    """benchmarks/bench_capture_overhead.py on this device, in what the budget leaves: wall time of the
    training loop under each capture configuration over the plain loop, thread and process CPU beside it."""
    lines = []
    for i, (label, model_args) in enumerate(OVERHEAD_RUNS):
        left = budget.left(600) / (len(OVERHEAD_RUNS) - i)  # a share for each run still to come
        if left < 45:
            lines.append(f"  overhead {label}: not run ({left:.0f}s of the budget left)")
            continue
        out = logs / f"overhead-{label}.json"
        cmd = [py, str(REPO / "benchmarks" / "bench_capture_overhead.py"), "--device", device, *model_args,
               "--configs", OVERHEAD_CONFIGS, "--rounds", "3", "--steps", "30", "--json", str(out)]
        rc, last = _run(cmd, left, _child_env(), log=logs / f"overhead-{label}.log")
        if rc != 0 or not out.exists():
            lines.append(f"  overhead {label}: FAILED (exit {rc}): {last[:150]}")
            continue
        res = json.loads(out.read_text())
        lines.append(f"  overhead {label} {res.get('shape')} on {res.get('device')}, ms per step (wall/thread/process):")
        for cfg, ms in res["step_ms"].items():
            r = res["ratio_vs_base"][cfg]
            lines.append(f"    {cfg:<15} {ms['wall']:8.2f} {ms['thread']:8.2f} {ms['process']:8.2f}   "
                         f"x{r['wall']:.3f} x{r['thread']:.3f} x{r['process']:.3f}")
    return lines


def parent(args: argparse.Namespace) -> int:
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: SKIPPED: torch sees no CUDA device (torch.cuda.is_available() is False); nothing was checked")
        return 0
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    budget = Budget(args.budget_s)
    t0 = time.monotonic()
    py = sys.executable
    lines = [f"gpu-check on {device_name}, torch {torch.__version__}, {args.steps} steps per run"]
    ok = True
    work_root = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    logs = Path(args.logs) if args.logs else work_root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = _child_env(PLASMIENT_EVERY="1", PLASMIENT_OVERHEAD="0")

    rc, last = _run([py, "-m", "plasmient_trace.capture.native"], budget.left(240), env, log=logs / "native-build.log")
    lines.append(f"  native op observer build: {'OK' if rc == 0 else f'FAILED (exit {rc}): {last}'}")

    for name in args.workloads.split(","):
        results: dict[str, dict] = {}
        for variant in args.variants.split(","):
            work = work_root / name / variant
            cmd = [py, str(Path(__file__).resolve()), "--child", name, variant, "--work", str(work),
                   "--steps", str(args.steps), "--device", args.device]
            rc, last = _run(cmd, budget.left(150), env, log=logs / f"{name}-{variant}.log")
            if rc == 0:
                results[variant] = json.loads((work / "result.json").read_text())
            else:
                ok = False
                lines.append(f"  {name}/{variant}: FAILED (exit {rc}): {last[:150]}")
        prof = results.get("profiler")
        for variant, res in results.items():
            if variant == "profiler":
                continue
            kernels, agree, differ = _compare(res["joins"], prof["joins"]) if prof else (0, 0, [("?", "no profiler run")])
            same = not differ and (kernels > 0 or args.device != "cuda")
            within = ""
            if variant == "dispatch" and prof:
                # the coarser fallback passes when each kernel sits under the profiler's op or an op around it
                inside = _within_chain(res["joins"], prof["chains"])
                same = inside == kernels == sum(r[3] for r in prof["joins"]) and (kernels > 0 or args.device != "cuda")
                within = f", {inside}/{kernels} under the same op or one enclosing it"
            if args.device == "cuda" and variant != "dispatch":
                ok &= same and res["on_gpu"]
            verdict = ("OK" if same else "DIFFER") if args.device == "cuda" else "n/a: no kernels on a CPU"
            if variant == "dispatch" and not same:
                # The fallback runs some ops differently (a mode active: autograd accumulates out of place)
                # and sees composites only from outside: reported, not a failure of the default path.
                verdict += ", informational: the dispatch hook is the fallback"
            lines.append(f"  {name}/{variant}: {res['source']} via {res['op_recorder']}, CUPTI {res['cupti']}, "
                         f"{agree}/{kernels} joins as torch.profiler{within} ({verdict})")
            lines.append(f"    MFU {_fmt([r.get('plasmient.mfu') for r in res['steps']], '.3f')}, "
                         f"NVML util {_fmt([r.get('plasmient.util.nvml') for r in res['steps']], '.2f')}, "
                         f"steps dropped {res['stats'].get('steps_dropped')}"
                         + (f", batches stitched in the batch process {res['stats'].get('batches_in_child')}"
                            if variant == "process" else ""))
            for p, k in differ[:3]:
                lines.append(f"    differs: {p} -> {str(k)[:90]}")
        if prof:
            flops = [r.get("plasmient.flops") for r in prof["steps"]]
            lines.append(f"  {name}/profiler: {sum(r[3] for r in prof['joins'])} kernels, FLOPs per step {_fmt(flops, '.3e')}")
        native = work_root / name / "native"
        if args.fixtures and "native" in results and "profiler" in results:
            dest = Path(args.fixtures) / name
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            shutil.copytree(native / "cupti", dest / "cupti")
            shutil.copytree(native / "records", dest / "records")
            shutil.copy(work_root / name / "profiler" / "profiler.json.gz", dest / "profiler.json.gz")
            joins = {v: r["joins"] for v, r in results.items()}
            meta = {"workload": name, "steps": args.steps, "device": device_name, "torch": torch.__version__,
                    "cuda": torch.version.cuda, "joins": joins,
                    "step_spans": {v: r["steps"] for v, r in results.items()}}
            (dest / "check.json").write_text(json.dumps(meta, indent=1, default=str))
            lines.append(f"    fixtures -> {dest}")

    for label, script in (("example-tiny", ["examples/train_tiny_transformer.py", "--steps", "12"]),
                          ("example-decode", ["examples/decode_vs_gemm.py", "--steps", "3"])):
        good, out = _example(py, work_root, logs, budget, label, script, args.device)
        ok &= good
        lines += out
    if args.overhead:
        lines += _overhead(py, logs, budget, args.device)
    lines.append(f"{'PASS' if ok else 'FAIL'} in {time.monotonic() - t0:.0f}s (logs in {logs})")
    print("\n".join(lines))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--fixtures", default=str(REPO / "tests" / "fixtures" / "gpu"),
                   help="where the recorded fixtures go (default tests/fixtures/gpu; '' = nowhere)")
    p.add_argument("--logs", default="", help="keep every child's output here (default: a temporary directory)")
    p.add_argument("--budget-s", type=float, default=440.0, help="the whole check's time budget")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"a subset of {','.join(WORKLOADS)}")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"a subset of {','.join(VARIANTS)} (the joins compare against profiler)")
    p.add_argument("--overhead", action="store_true",
                   help="then run the capture-overhead benchmark (tiny model, GPT-2 shape) in the time the budget leaves")
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.workload, args.variant = args.child
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
