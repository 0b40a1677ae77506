"""Span attribute conventions and the columnar span table every exporter reads.

The stitcher emits a :class:`SpanBatch`: one Arrow table with one row per span and one column per
attribute, named exactly as the attribute key. A null cell means "attribute absent on this span"
(e.g. ``plasmient.mfu`` on a GPU whose peak is unknown). Exporters (OTLP JSON, OTLP protobuf,
Parquet, the HTML report) walk these columns; nothing builds per-span Python objects on the hot path.

This module is the single source of truth for the names, types, units and meaning of every
attribute; ``schemas/span_attributes.json`` is generated from it and checked in CI.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

LEVELS = ("fleet", "node", "rank", "step", "module", "op", "kernel")
ABOVE_STEP = ("fleet", "node", "rank", "step")
BOUNDS = ("compute", "memory", "latency", "communication", "idle")
DEFAULT_BASELINE_MFU = 0.46  # PaLM's reported MFU, the DESIGN default for "not wasted"
SCOPE_NAME = "plasmient_trace"


@dataclass(frozen=True)
class SpanAttribute:
    name: str
    type: pa.DataType
    unit: str
    levels: tuple[str, ...]
    description: str


_ALL = LEVELS
_F = pa.float64()
_I = pa.int64()
_S = pa.string()

SPAN_ATTRIBUTES: tuple[SpanAttribute, ...] = (
    SpanAttribute("plasmient.level", _S, "", _ALL, "fleet | node | rank | step | module | op | kernel"),
    SpanAttribute("plasmient.job.id", _S, "", _ALL, "job id the deterministic trace id derives from"),
    SpanAttribute("plasmient.step", _I, "", _ALL, "step index (ProfilerStep#N, optimizer step, or 0 for a whole capture)"),
    SpanAttribute("plasmient.rank", _I, "", ("rank", "step", "module", "op", "kernel"), "global rank of the process"),
    SpanAttribute("plasmient.device.type", _S, "", _ALL, "gpu | cpu: what the metrics of this span were measured on"),
    SpanAttribute("plasmient.gpus", _I, "{gpu}", _ALL, "devices the span's window is charged for"),
    SpanAttribute("plasmient.wall_s", _F, "s", _ALL, "end - start of the span"),
    SpanAttribute("plasmient.flops", _F, "{flop}", _ALL, "useful FLOPs of the kernels under the span; parent = sum of children (+ folded)"),
    SpanAttribute("plasmient.ideal_s", _F, "s", _ALL, "sum over kernels of flops / peak(dtype): time the work needs at peak"),
    SpanAttribute("plasmient.busy_s", _F, "s", _ALL, "union of kernel-resident time of the kernels under the span, per device, summed over devices"),
    SpanAttribute("plasmient.util.resident", _F, "1", _ALL, "busy / (wall * gpus): what nvidia-smi utilization.gpu reports"),
    SpanAttribute("plasmient.mfu", _F, "1", _ALL, "ideal_s / (wall * gpus) = flops / (peak * wall * gpus); absent when the peak is unknown"),
    SpanAttribute("plasmient.stall_fraction", _F, "1", _ALL, "1 - ideal_s / busy: resident time that issued no useful math; absent when busy = 0 or peak unknown"),
    SpanAttribute("plasmient.idle_fraction", _F, "1", _ALL, "1 - util.resident"),
    SpanAttribute("plasmient.bytes", _F, "By", _ALL, "bytes moved to/from device memory by the kernels under the span (model from op shapes, memcpy/memset sizes)"),
    SpanAttribute("plasmient.arithmetic_intensity", _F, "{flop}/By", _ALL, "flops / bytes; absent when bytes = 0"),
    SpanAttribute("plasmient.bound", _S, "", _ALL, "compute | memory | latency | communication | idle, against the device's ridge point"),
    SpanAttribute("plasmient.cost.usd", _F, "USD", _ALL, "price per GPU-hour * wall * gpus / 3600; absent when no price is known"),
    SpanAttribute("plasmient.cost.wasted_usd", _F, "USD", _ALL, "cost * max(0, 1 - mfu / baseline_mfu)"),
    SpanAttribute("plasmient.wasted_s", _F, "s", _ALL, "device-seconds below the baseline MFU: wall*gpus - ideal_s/baseline, at least 0"),
    SpanAttribute("plasmient.kernels", _I, "{kernel}", _ALL, "GPU activities under the span (exported or folded)"),
    SpanAttribute("plasmient.kernels.folded", _I, "{kernel}", ("op", "step"), "kernels not exported as spans because of the span budget, folded into this span"),
    SpanAttribute("plasmient.kernels.folded_s", _F, "s", ("op", "step"), "summed duration of the folded kernels"),
    SpanAttribute("plasmient.kernels.folded_flops", _F, "{flop}", ("op", "step"), "flops of the folded kernels (part of this span's flops)"),
    SpanAttribute("plasmient.kernels.over_peak", _I, "{kernel}", ("step",), "kernels whose modelled flops exceeded peak * duration and were capped"),
    SpanAttribute("plasmient.unjoined_kernels", _I, "{kernel}", ("step",), "kernels with no launch or no op; kept, parented to the step"),
    SpanAttribute("plasmient.peak_flops", _F, "{flop}/s", ("fleet", "node", "rank", "step"), "dense peak of the device for its dominant dtype"),
    SpanAttribute("plasmient.fleet.ranks_missing", _I, "{rank}", ("fleet", "node"), "live multi-rank: ranks whose step summary had not arrived within PLASMIENT_FLEET_WAIT_S"),
    SpanAttribute("plasmient.peak_bandwidth", _F, "By/s", ("fleet", "node", "rank", "step"), "memory bandwidth of the device (roofline slope)"),
    SpanAttribute("plasmient.peak.source", _S, "", ("rank",), "table:<model> | override | calibrated | unknown"),
    SpanAttribute("plasmient.clock.offset_ns", _I, "ns", ("rank",), "shift applied to GPU timestamps so no kernel starts before its launch"),
    SpanAttribute("plasmient.util.nvml", _F, "1", ("step",), "mean NVML utilization.gpu sampled during the step"),
    SpanAttribute("plasmient.gpm.sm_active", _F, "1", ("step",), "GPM SM activity during the step"),
    SpanAttribute("plasmient.gpm.tensor_active", _F, "1", ("step",), "GPM tensor-pipe activity during the step"),
    SpanAttribute("plasmient.gpm.dram_bw_util", _F, "1", ("step",), "GPM DRAM bandwidth utilisation during the step"),
    SpanAttribute("plasmient.cupti.dropped_records", _I, "{record}", ("step",), "activity records CUPTI dropped during the step"),
    SpanAttribute("plasmient.sampled_depth", _S, "", ("step",), "full | step: whether the step carries its whole subtree"),
    SpanAttribute("plasmient.culprit.module", _S, "", ABOVE_STEP, "module holding the most wasted device time"),
    SpanAttribute("plasmient.culprit.op", _S, "", ABOVE_STEP, "op holding the most wasted device time"),
    SpanAttribute("plasmient.culprit.kernel", _S, "", ABOVE_STEP, "kernel holding the most wasted device time"),
    SpanAttribute("plasmient.culprit.rank", _I, "", ("fleet", "node"), "rank with the most wasted device time"),
    SpanAttribute("plasmient.culprit.wasted_s", _F, "s", ABOVE_STEP, "wasted device-seconds of the culprit kernel"),
    SpanAttribute("plasmient.culprit.bound", _S, "", ABOVE_STEP, "bound of the culprit kernel"),
    SpanAttribute("plasmient.culprit.suggestion", _S, "", ABOVE_STEP, "one-line suggestion for the culprit"),
    SpanAttribute("plasmient.module.path", _S, "", ("module",), "nn.Module path (live) or nesting of class instances (Kineto)"),
    SpanAttribute("plasmient.module.phase", _S, "", ("module",), "forward | backward"),
    SpanAttribute("plasmient.op.external_id", _I, "", ("op",), "Kineto External id / CUPTI external correlation id"),
    SpanAttribute("plasmient.op.sequence_number", _I, "", ("op",), "autograd sequence number"),
    SpanAttribute("plasmient.op.input_dims", _S, "", ("op",), "JSON list of input shapes"),
    SpanAttribute("plasmient.op.input_types", _S, "", ("op",), "JSON list of input dtypes"),
    SpanAttribute("plasmient.op.dtype", _S, "", ("op",), "dtype the peak was looked up for"),
    SpanAttribute("plasmient.op.flops_model", _S, "", ("op",), "gemm | conv | attention | norm | softmax | elementwise | embedding | none"),
    SpanAttribute("plasmient.op.model_flops", _F, "{flop}", ("op",), "flops the shape model gives this op alone (before attribution to kernels)"),
    SpanAttribute("plasmient.op.kineto_flops", _F, "{flop}", ("op",), "Kineto's own flops estimate, a cross-check"),
    SpanAttribute("plasmient.op.cpu_s", _F, "s", ("op", "module"), "CPU-side duration of the op/module"),
    SpanAttribute("thread.id", _I, "", ("op", "module"), "OS thread id (OTel semantic convention)"),
    SpanAttribute("plasmient.correlation_id", _I, "", ("kernel",), "CUPTI correlation id joining the kernel to its launch"),
    SpanAttribute("plasmient.kernel.kind", _S, "", ("kernel",), "kernel | memcpy | memset | collective"),
    SpanAttribute("plasmient.kernel.launch", _S, "", ("kernel",), "runtime call that launched it (cudaLaunchKernel, cudaGraphLaunch, ...)"),
    SpanAttribute("plasmient.gpu.device", _I, "", ("kernel",), "device ordinal"),
    SpanAttribute("plasmient.gpu.stream", _I, "", ("kernel",), "stream id"),
    SpanAttribute("plasmient.kernel.grid", _S, "", ("kernel",), "grid dims 'x,y,z'"),
    SpanAttribute("plasmient.kernel.block", _S, "", ("kernel",), "block dims 'x,y,z'"),
    SpanAttribute("plasmient.kernel.registers_per_thread", _I, "", ("kernel",), "registers per thread"),
    SpanAttribute("plasmient.kernel.shared_memory", _I, "By", ("kernel",), "shared memory per block"),
    SpanAttribute("plasmient.kernel.graph_id", _I, "", ("kernel",), "CUDA graph id"),
)

ATTRIBUTE_BY_NAME = {a.name: a for a in SPAN_ATTRIBUTES}

# Columns of the span table that are not attributes.
CORE_COLUMNS = pa.schema(
    [
        pa.field("trace_id", pa.binary(16), nullable=False),
        pa.field("span_id", pa.uint64(), nullable=False),
        pa.field("parent_span_id", pa.uint64(), nullable=False, metadata={"doc": "0 = root"}),
        pa.field("resource_index", pa.int32(), nullable=False, metadata={"doc": "index into SpanBatch.resources"}),
        pa.field("name", pa.string(), nullable=False),
        pa.field("start_ns", pa.int64(), nullable=False, metadata={"doc": "Unix epoch ns"}),
        pa.field("end_ns", pa.int64(), nullable=False),
    ]
)

SPAN_TABLE_SCHEMA = pa.schema(list(CORE_COLUMNS) + [pa.field(a.name, a.type) for a in SPAN_ATTRIBUTES])

# Resource attribute keys we set. OTel semantic-convention names where they exist.
RESOURCE_ATTRIBUTES: dict[str, str] = {
    "service.name": "OTEL_SERVICE_NAME, else 'plasmient-trace'",
    "service.instance.id": "job/rank, unique per process",
    "host.name": "node the rank ran on",
    "process.pid": "pid of the traced process",
    "k8s.namespace.name": "Kubernetes downward API (POD_NAMESPACE / K8S_NAMESPACE)",
    "k8s.pod.name": "Kubernetes downward API (POD_NAME / K8S_POD_NAME)",
    "k8s.node.name": "Kubernetes downward API (NODE_NAME / K8S_NODE_NAME)",
    "plasmient.job.id": "--job-id / PLASMIENT_JOB_ID / SLURM_JOB_ID / TORCHELASTIC_RUN_ID",
    "plasmient.rank": "global rank (distributedInfo.rank, RANK, SLURM_PROCID)",
    "plasmient.world_size": "world size (distributedInfo.world_size, WORLD_SIZE, SLURM_NTASKS)",
    "plasmient.local_rank": "LOCAL_RANK / SLURM_LOCALID",
    "plasmient.gpu.model": "device name as the driver reports it",
    "plasmient.gpu.uuid": "device UUID where known",
    "plasmient.gpu.count": "devices used by the process",
    "plasmient.slurm.job_id": "SLURM_JOB_ID",
    "plasmient.slurm.step_id": "SLURM_STEP_ID",
    "plasmient.source": "file path or live source the records came from",
    "plasmient.distributed.backend": "nccl | gloo | ...",
}


@dataclass
class SpanBatch:
    """Spans of one or more traces in columnar form, plus the resources they refer to."""

    table: pa.Table
    resources: list[dict[str, Any]] = field(default_factory=list)

    def __len__(self) -> int:
        return self.table.num_rows

    def trace_ids(self) -> list[bytes]:
        return sorted(set(self.table.column("trace_id").to_pylist()))


def empty_span_table() -> pa.Table:
    return SPAN_TABLE_SCHEMA.empty_table()


def span_table_from_columns(columns: dict[str, Any], length: int) -> pa.Table:
    """Assemble a span table; absent attribute columns become all-null."""
    arrays = []
    for f in SPAN_TABLE_SCHEMA:
        value = columns.get(f.name)
        if value is None:
            if not f.nullable:
                raise ValueError(f"span column {f.name} is required")
            arrays.append(pa.nulls(length, type=f.type))
        elif isinstance(value, (pa.Array, pa.ChunkedArray)):
            value = value.cast(f.type) if value.type != f.type else value
            arrays.append(value.combine_chunks() if isinstance(value, pa.ChunkedArray) else value)
        else:
            arrays.append(pa.array(value, type=f.type))
    return pa.Table.from_arrays(arrays, schema=SPAN_TABLE_SCHEMA)
