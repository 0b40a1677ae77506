"""Benchmark: encode span batches to OTLP/JSON lines and to OTLP protobuf requests.

1. Real outputs: the largest shared traces ingested with a span budget that keeps every kernel
   (``--max-spans``), then written as JSONL to a file and to /dev/null, ``--rounds`` times each.
   Prints the first round (what an ingest pays once) and the median, in spans/s of CPU time.
2. A synthetic batch of ``--spans`` spans with random (all-distinct) numbers, through both encoders.

Spans/s are by this process's CPU time (user + system; the encoders are single-threaded, so that is
one core's time even on a busy machine) with the ratio to the 200,000 spans/s target. With
``--generated N`` it also times building the same requests from the generated protobuf classes
(one Span message per span) on the first N spans, the alternative otlp_proto.py did not take.

    .venv/bin/python benchmarks/bench_encode.py [--traces a100/cuda_graphs_rank0_of16.json.gz ...]
        [--max-spans 10000000] [--rounds 5] [--spans 1000000] [--generated 20000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from plasmient_trace.conventions import (
    LEVELS,
    SPAN_ATTRIBUTES,
    SpanBatch,
    span_table_from_columns,
)
from plasmient_trace.export import otlp_json, otlp_proto

TARGET_SPANS_PER_S = 200_000
REAL_TRACES = ("a100/cuda_graphs_rank0_of16.json.gz", "v100/resnet50_training.json.gz")

# Share of spans per level in a realistic step trace: kernels dominate, then ops, then modules.
_LEVEL_SHARE = {"fleet": 0.0001, "node": 0.0001, "rank": 0.0002, "step": 0.0002, "module": 0.03, "op": 0.25, "kernel": 0.7194}
# Share of a level's spans that carry an attribute, where it is not all of them.
_PRESENCE = {
    "plasmient.stall_fraction": 0.9,  # absent when busy = 0 (ops that launched nothing)
    "plasmient.arithmetic_intensity": 0.95,  # absent when bytes = 0
    "plasmient.op.input_dims": 0.7,  # Kineto records shapes for most ops, not all
    "plasmient.op.input_types": 0.7,
    "plasmient.op.sequence_number": 0.5,  # autograd ops only
    "plasmient.op.kineto_flops": 0.2,  # GEMM/conv ops only
    "plasmient.op.model_flops": 0.6,
    "plasmient.kernels.folded": 0.1,
    "plasmient.kernels.folded_s": 0.1,
    "plasmient.kernels.folded_flops": 0.1,
    "plasmient.kernel.graph_id": 0.1,  # graph launches only
    "plasmient.gpm.sm_active": 0.5,  # GPUs with GPM
    "plasmient.gpm.tensor_active": 0.5,
    "plasmient.gpm.dram_bw_util": 0.5,
    "plasmient.cupti.dropped_records": 0.05,
}
_STRING_VOCAB = {
    "plasmient.level": list(LEVELS),
    "plasmient.device.type": ["gpu", "cpu"],
    "plasmient.bound": ["compute", "memory", "latency", "communication", "idle"],
    "plasmient.kernel.kind": ["kernel", "memcpy", "memset", "collective"],
    "plasmient.kernel.launch": ["cudaLaunchKernel", "cudaGraphLaunch", "cudaMemcpyAsync", "cuLaunchKernel"],
    "plasmient.module.phase": ["forward", "backward"],
    "plasmient.op.dtype": ["bf16", "fp16", "fp32", "fp8"],
    "plasmient.op.flops_model": ["gemm", "conv", "attention", "norm", "softmax", "elementwise", "embedding", "none"],
    "plasmient.sampled_depth": ["full", "step"],
    "plasmient.peak.source": ["table:H100 80GB HBM3", "override", "calibrated", "unknown"],
}


def _vocab(name: str, rng: np.random.Generator) -> list[str]:
    if name in _STRING_VOCAB:
        return _STRING_VOCAB[name]
    if name in ("plasmient.kernel.grid", "plasmient.kernel.block"):
        return [f"{x},{y},1" for x in (1, 32, 128, 256, 1024) for y in (1, 2, 8, 64)]
    if name == "plasmient.op.input_dims":
        return [f"[[{a}, {b}], [{b}, {c}]]" for a, b, c in rng.integers(1, 8192, size=(2000, 3))]
    if name == "plasmient.op.input_types":
        return ['["c10::BFloat16", "c10::BFloat16"]', '["float", "float", "Scalar"]', '["c10::Half"]']
    if name == "plasmient.culprit.suggestion":
        return ["memory-bound decode attention: raise the batch or use a different attention kernel", "launch-bound: capture with CUDA graphs"]
    return [f"model.layers.{i}.self_attn" for i in range(64)] + [f"aten::op_{i}" for i in range(64)]


_KERNEL_NAMES = [
    f"void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_{m}x{n}_64x3_tn_align8>(Params)"
    for m in (64, 128, 256)
    for n in (64, 128, 256)
] + [f"ampere_sgemm_{i}x64_nn" for i in range(100)] + ["void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"]
_OP_NAMES = ["aten::mm", "aten::addmm", "aten::_scaled_dot_product_flash_attention", "aten::layer_norm", "aten::gelu", "aten::add_", "aten::copy_"]


def synthetic_batch(n: int, spans_per_trace: int = 10_000, seed: int = 0) -> SpanBatch:
    """A span table shaped like the stitcher's output: per-level attribute density, 2 resources."""
    rng = np.random.default_rng(seed)
    levels = rng.choice(len(LEVELS), size=n, p=[_LEVEL_SHARE[level] for level in LEVELS])
    trace_no = np.arange(n) // spans_per_trace
    trace_ids = rng.integers(0, 256, size=(int(trace_no.max()) + 1, 16), dtype=np.uint8)
    start = 1_700_000_000_000_000_000 + np.arange(n, dtype=np.int64) * 1000 + rng.integers(0, 500, n)
    span_ids = rng.integers(1, 2**63, size=n, dtype=np.int64).astype(np.uint64)
    parents = np.roll(span_ids, 1)
    parents[np.arange(n) % spans_per_trace == 0] = 0
    names = np.where(
        levels == LEVELS.index("kernel"),
        np.array(_KERNEL_NAMES, dtype=object)[rng.integers(0, len(_KERNEL_NAMES), n)],
        np.array(_OP_NAMES, dtype=object)[rng.integers(0, len(_OP_NAMES), n)],
    )
    columns: dict[str, object] = {
        "trace_id": pa.array(list(map(bytes, trace_ids[trace_no])), pa.binary(16)),
        "span_id": span_ids,
        "parent_span_id": parents,
        "resource_index": (trace_no % 2).astype(np.int32),
        "name": pa.array(names.tolist(), pa.string()),
        "start_ns": start,
        "end_ns": start + rng.integers(1_000, 2_000_000, n),
    }
    for attr in SPAN_ATTRIBUTES:
        allowed = np.isin(levels, [LEVELS.index(level) for level in attr.levels])
        # As the stitcher fills them: every span of the attribute's levels, except where the value
        # does not exist (no shapes recorded, no autograd, no GPM, nothing folded, bytes = 0, ...).
        present = allowed & (rng.random(n) < _PRESENCE.get(attr.name, 1.0))
        if attr.name.startswith("plasmient.cost."):
            present &= trace_no % 2 == 0  # no GPU-hour price known for the second resource's node
        if attr.name == "plasmient.level":
            columns[attr.name] = pa.array(np.array(LEVELS, dtype=object)[levels].tolist(), pa.string())
            continue
        if pa.types.is_string(attr.type):
            vocab = np.array(_vocab(attr.name, rng), dtype=object)
            values = vocab[rng.integers(0, len(vocab), n)]
            columns[attr.name] = pa.array(values.tolist(), pa.string(), mask=~present)
        elif pa.types.is_integer(attr.type):
            if attr.name == "plasmient.clock.offset_ns":
                ints = rng.integers(-(10**9), 10**9, n)  # signed: negative int64s are 10-byte varints
            else:
                ints = np.exp(rng.uniform(0, np.log(2**24), n)).astype(np.int64)  # steps, ranks, ids, counts
            columns[attr.name] = pa.array(ints, pa.int64(), mask=~present)
        else:
            columns[attr.name] = pa.array(rng.random(n) * 10.0 ** rng.integers(-9, 15, n), pa.float64(), mask=~present)
    resources = [
        {"service.name": "plasmient-trace", "host.name": f"node-{r}", "plasmient.rank": r, "plasmient.job.id": "bench"}
        for r in range(2)
    ]
    return SpanBatch(span_table_from_columns(columns, n), resources)


def _generated_requests(batch: SpanBatch) -> int:
    """The road not taken: one generated Span message per span (upb), for comparison only."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import Span

    table = batch.table
    cols = {name: table.column(name).to_pylist() for name in table.column_names}
    attr_names = [c for c in table.column_names if c not in ("trace_id", "span_id", "parent_span_id", "resource_index", "name", "start_ns", "end_ns")]
    req = ExportTraceServiceRequest()
    spans = req.resource_spans.add().scope_spans.add().spans
    total = 0
    for i in range(table.num_rows):
        attrs = []
        for name in attr_names:
            v = cols[name][i]
            if v is None:
                continue
            if isinstance(v, str):
                attrs.append(KeyValue(key=name, value=AnyValue(string_value=v)))
            elif isinstance(v, int):
                attrs.append(KeyValue(key=name, value=AnyValue(int_value=v)))
            else:
                attrs.append(KeyValue(key=name, value=AnyValue(double_value=v)))
        parent = cols["parent_span_id"][i]
        spans.append(
            Span(
                trace_id=cols["trace_id"][i],
                span_id=cols["span_id"][i].to_bytes(8, "big"),
                parent_span_id=parent.to_bytes(8, "big") if parent else b"",
                name=cols["name"][i],
                kind=Span.SPAN_KIND_INTERNAL,
                start_time_unix_nano=cols["start_ns"][i],
                end_time_unix_nano=cols["end_ns"][i],
                attributes=attrs,
            )
        )
    total += len(req.SerializeToString())
    return total


def _cpu_seconds(fn: object) -> float:
    t = os.times()
    fn()  # type: ignore[operator]
    u = os.times()
    return (u.user - t.user) + (u.system - t.system)


def bench_real(traces_dir: Path, names: list[str], max_spans: int, rounds: int) -> None:
    """Encode the stitcher's real output: first round and median over rounds, to a file and to /dev/null."""
    from plasmient_trace.pipeline import IngestOptions, stitch_records
    from plasmient_trace.sources.kineto import read_kineto

    print(f"real traces (--max-spans {max_spans}), JSONL, spans/s of CPU time: first round / median of {rounds}")
    for name in names:
        path = traces_dir / name
        if not path.exists():
            print(f"  {name}: not found under {traces_dir}, skipped")
            continue
        batch = stitch_records([read_kineto(path)], IngestOptions(job_id="bench", max_spans=max_spans)).batch
        n = len(batch)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "traces.jsonl"
            to_file, to_null = [], []
            for _ in range(rounds):
                to_file.append(_cpu_seconds(lambda: otlp_json.write_jsonl(batch, out)))  # noqa: B023
                with open(os.devnull, "wb") as devnull:
                    to_null.append(_cpu_seconds(lambda: otlp_json.write_jsonl(batch, devnull)))  # noqa: B023
            size = out.stat().st_size
        for label, cpu in (("to a file", to_file), ("/dev/null", to_null)):
            med = statistics.median(cpu)
            print(f"  {name[:40]:40s} {n:7,} spans {size / 2**20:5.0f} MiB {label:9s}: first {n / max(cpu[0], 1e-9):9,.0f}  "
                  f"median {n / max(med, 1e-9):9,.0f} spans/s = {n / max(med, 1e-9) / TARGET_SPANS_PER_S:4.2f}x the 200k target")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="*", default=list(REAL_TRACES), help="shared traces to encode (none: skip)")
    parser.add_argument("--traces-dir", type=Path, default=REPO.parent / "shared" / "traces")
    parser.add_argument("--max-spans", type=int, default=10_000_000, help="span budget per trace for the real traces")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--spans", type=int, default=1_000_000, help="synthetic spans (0: skip)")
    parser.add_argument("--generated", type=int, default=20_000, help="spans for the generated-classes comparison (0: skip)")
    args = parser.parse_args()

    if args.traces:
        bench_real(args.traces_dir, args.traces, args.max_spans, args.rounds)
    if not args.spans:
        return

    t0 = time.perf_counter()
    batch = synthetic_batch(args.spans)
    t_build = time.perf_counter() - t0
    table = batch.table
    filled = sum(table.num_rows - table.column(c).null_count for c in table.column_names[7:]) / table.num_rows
    print(f"synthetic batch: {len(batch):,} spans, {len(batch.trace_ids())} traces, {filled:.1f} attributes/span (built in {t_build:.1f}s)")

    def report(label: str, spans: int, wall: float, cpu: float, extra: str) -> None:
        # CPU seconds of this (single-threaded) process = one core, whatever else the machine runs.
        print(
            f"{label:<16}: {wall:6.2f} s wall {spans / wall:10,.0f} spans/s | {cpu:6.2f} s cpu "
            f"{spans / cpu:10,.0f} spans/s = {spans / cpu / TARGET_SPANS_PER_S:4.2f}x the 200k target  {extra}"
        )

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "traces.jsonl")
        t0, c0 = time.perf_counter(), time.process_time()
        lines = otlp_json.write_jsonl(batch, path)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        size = os.path.getsize(path)
    report("OTLP/JSON lines", len(batch), wall, cpu, f"({lines} lines, {size / 2**20:,.0f} MiB to a file)")

    # The same encoding with the file system's share taken out (page-cache writes of GiBs cost
    # seconds of kernel CPU on some VMs, whatever wrote the bytes).
    with open(os.devnull, "wb") as devnull:
        t0, c0 = time.perf_counter(), time.process_time()
        otlp_json.write_jsonl(batch, devnull)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    report("  encode only", len(batch), wall, cpu, "(same lines to /dev/null)")

    t0, c0 = time.perf_counter(), time.process_time()
    n_req = 0
    n_bytes = 0
    for req in otlp_proto.encode_requests(batch):
        n_req += 1
        n_bytes += len(req)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    report("OTLP protobuf", len(batch), wall, cpu, f"({n_req} requests <= 3.5 MiB, {n_bytes / 2**20:,.0f} MiB)")

    if args.generated:
        sub = SpanBatch(table.slice(0, args.generated), batch.resources)
        t0, c0 = time.perf_counter(), time.process_time()
        _generated_requests(sub)
        report("generated pb2", len(sub), time.perf_counter() - t0, time.process_time() - c0, "(comparison: one Span message per span)")


if __name__ == "__main__":
    main()
