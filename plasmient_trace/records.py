"""Record tables: the normalised, source-independent form of everything a capture saw.

Every source (offline Kineto JSON, live CUPTI + torch hooks, live torch.profiler) produces one
:class:`RecordSet` per process (rank). The stitcher only ever reads these Arrow tables, so a new
source needs to fill these schemas and nothing else. All timestamps are int64 nanoseconds on the
CPU wall clock of the process (Unix epoch where the source knows it); GPU timestamps are mapped
onto that clock by the stitcher (``stitch.clock``), never here.

The schemas below are the single source of truth: ``schemas/records.json`` is generated from them
(``python -m plasmient_trace.schemas``) and a test fails when the two drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

# One GPU activity: a kernel, a memcpy, a memset, or a collective kernel (see COLLECTIVE_KERNEL).
GPU_ACTIVITY_KINDS = ("kernel", "memcpy", "memset", "collective")

# Kernels that move data between GPUs, by name (case-insensitive, anywhere in the name): NCCL's and RCCL's; the
# peer-to-peer kernels of torch's symmetric memory (symm_mem::multimem_all_reduce_, one_shot_all_reduce,
# two_shot_all_reduce_, multimem_all_gather_out, reduce_scatter_out launch multimem_*_kernel, one_shot_*_kernel
# and two_shot_*_kernel); vLLM's custom all-reduce (cross_device_reduce_1stage / _2stage). They are
# communication, whatever category the source gave them: a vLLM job on B200s that all-reduces through
# NVLink multicast spends 18% of its device time in multimem_all_reduce_kernel. One pattern, in Python's re and
# Arrow's RE2 alike.
COLLECTIVE_KERNEL = r"nccl|rccl|\b(?:multimem|one_shot|two_shot)_\w*_kernel|cross_device_reduce_[12]stage"
_COLLECTIVE_KERNEL_RE = re.compile(COLLECTIVE_KERNEL, re.IGNORECASE)


def is_collective_kernel(name: str) -> bool:
    """Whether a GPU kernel's name is a collective's (COLLECTIVE_KERNEL)."""
    return _COLLECTIVE_KERNEL_RE.search(name) is not None


def collective_kernel_names(names: pa.Array) -> pa.Array:
    """is_collective_kernel for each name of an Arrow string array, as Arrow booleans (null for a null name)."""
    return pc.match_substring_regex(names, COLLECTIVE_KERNEL, ignore_case=True)


# Host ops (RecordFunction names) of collectives: c10d's, the backends' own scopes (gloo:all_reduce, nccl:...).
_COLLECTIVE_OP = ("nccl", "rccl", "gloo", "c10d::", "allreduce", "all_reduce", "allgather", "all_gather",
                  "reduce_scatter", "reducescatter", "alltoall", "all_to_all", "broadcast_", "barrier")


def collective_op_names(names: pa.Array) -> pa.Array:
    """Per host op name of an Arrow string array: is it a collective's (Arrow booleans)."""
    lower = pc.utf8_lower(names)
    hit = pc.match_substring(lower, _COLLECTIVE_OP[0])
    for token in _COLLECTIVE_OP[1:]:
        hit = pc.or_(hit, pc.match_substring(lower, token))
    return hit

KERNELS = pa.schema(
    [
        pa.field("device", pa.int32(), nullable=False, metadata={"doc": "GPU ordinal within the process's node"}),
        pa.field("stream", pa.int64(), metadata={"doc": "CUDA/HIP stream id"}),
        pa.field("start_ns", pa.int64(), nullable=False, metadata={"doc": "start, ns, source clock of the GPU"}),
        pa.field("end_ns", pa.int64(), nullable=False, metadata={"doc": "end, ns"}),
        pa.field("name", pa.string(), nullable=False, metadata={"doc": "kernel symbol, or 'Memcpy HtoD ...'"}),
        pa.field("kind", pa.string(), nullable=False, metadata={"doc": "kernel | memcpy | memset | collective"}),
        pa.field("correlation_id", pa.int64(), metadata={"doc": "CUPTI/roctracer correlation id of the launch"}),
        pa.field("external_id", pa.int64(), metadata={"doc": "external id recorded on the activity itself, if any"}),
        pa.field("grid", pa.list_(pa.int32(), 3), metadata={"doc": "grid dims x,y,z"}),
        pa.field("block", pa.list_(pa.int32(), 3), metadata={"doc": "block dims x,y,z"}),
        pa.field("registers_per_thread", pa.int32()),
        pa.field("shared_memory", pa.int64(), metadata={"unit": "By"}),
        pa.field("graph_id", pa.int64(), metadata={"doc": "CUDA graph id when launched from a graph"}),
        pa.field("bytes", pa.int64(), metadata={"unit": "By", "doc": "bytes moved (memcpy/memset)"}),
        pa.field("model_flops", pa.float64(), metadata={"doc": "FLOPs of this kernel where a source knows them per kernel (Inductor's kernel_flop arg, a CUDA-graph capture pairing); null = not known per kernel (the owning op's model decides)"}),
        pa.field("model_bytes", pa.float64(), metadata={"unit": "By", "doc": "ideal device-memory bytes of this kernel, where known per kernel (Inductor's kernel_num_gb, a capture pairing)"}),
        pa.field("model_dtype", pa.string(), metadata={"doc": "canonical dtype of the kernel's math where known per kernel (fp32 | tf32 | bf16 | fp16 | fp8 | int8 | fp64 | other)"}),
        pa.field("capture_op", pa.string(), metadata={"doc": "CUDA/HIP graph replay: name of the op that launched this kernel when the graph was captured"}),
        pa.field("capture_module", pa.string(), metadata={"doc": "CUDA/HIP graph replay: nn.Module path of that capture-time op, where known"}),
        # NCCL/RCCL message metadata as PyTorch's c10d records it (Kineto args of the collective kernel).
        pa.field("comm_collective", pa.string(), metadata={"doc": "c10d collective name ('Collective name': allreduce, _allgather_base, reduce_scatter, all_to_all, send, ...)"}),
        pa.field("comm_in_nelems", pa.int64(), metadata={"doc": "'In msg nelems': elements of this rank's input (for all_gather the per-rank part, for reduce_scatter the whole)"}),
        pa.field("comm_out_nelems", pa.int64(), metadata={"doc": "'Out msg nelems': elements of this rank's output (for all_gather the whole, for reduce_scatter the per-rank part)"}),
        pa.field("comm_group_size", pa.int64(), metadata={"doc": "'Group size': ranks in the process group"}),
        pa.field("comm_dtype", pa.string(), metadata={"doc": "'dtype': c10 scalar type name of the message (Float, BFloat16, Long, ...)"}),
        pa.field("comm_process_group", pa.string(), metadata={"doc": "'Process Group Name' of the collective"}),
    ]
)

# Runtime calls that replay a captured CUDA/HIP graph: one launch, many kernels, no op of their own.
GRAPH_LAUNCH_NAMES = ("cudaGraphLaunch", "hipGraphLaunch", "cuGraphLaunch")

LAUNCHES = pa.schema(
    [
        pa.field("pid", pa.int64(), nullable=False),
        pa.field("tid", pa.int64(), nullable=False),
        pa.field("start_ns", pa.int64(), nullable=False),
        pa.field("end_ns", pa.int64(), nullable=False),
        pa.field("name", pa.string(), nullable=False, metadata={"doc": "cudaLaunchKernel, cudaGraphLaunch, hipLaunchKernel, ..."}),
        pa.field("correlation_id", pa.int64(), nullable=False),
        pa.field("external_id", pa.int64(), metadata={"doc": "Kineto 'External id' of the launching op"}),
    ]
)

EXTERNAL_CORRELATION = pa.schema(
    [
        pa.field("correlation_id", pa.int64(), nullable=False),
        pa.field("external_id", pa.int64(), nullable=False),
    ]
)

OPS = pa.schema(
    [
        pa.field("pid", pa.int64(), nullable=False),
        pa.field("tid", pa.int64(), nullable=False),
        pa.field("start_ns", pa.int64(), nullable=False),
        pa.field("end_ns", pa.int64(), nullable=False),
        pa.field("name", pa.string(), nullable=False),
        pa.field("category", pa.string(), nullable=False, metadata={"doc": "cpu_op | user_annotation"}),
        pa.field("external_id", pa.int64()),
        pa.field("sequence_number", pa.int64(), metadata={"doc": "autograd sequence number"}),
        pa.field("fwd_thread_id", pa.int64(), metadata={"doc": ">0 on backward ops: the forward thread"}),
        pa.field("input_dims", pa.string(), metadata={"doc": "JSON list of input shapes"}),
        pa.field("input_types", pa.string(), metadata={"doc": "JSON list of input dtypes"}),
        pa.field("kineto_flops", pa.float64(), metadata={"doc": "Kineto's own 'flops' estimate (cross-check only)"}),
        pa.field("concrete_inputs", pa.string(), metadata={"doc": "JSON list of Kineto 'Concrete Inputs': scalar args as strings, '' for tensors (conv stride, is_causal, ...)"}),
        pa.field("input_strides", pa.string(), metadata={"doc": "JSON list of Kineto 'Input Strides', kept only where an input is broadcast (stride 0 over a dimension longer than 1: an expand reads its elements once); null: every input dense"}),
        pa.field("raised", pa.bool_(), metadata={"doc": "true: an exception propagated out of the op (checkpoint's early stop, an error), so it did not complete and its FLOPs are unknown; recorded by live capture's native observer, null where the source does not say (Kineto)"}),
    ]
)

MODULES = pa.schema(
    [
        pa.field("pid", pa.int64(), nullable=False),
        pa.field("tid", pa.int64(), nullable=False),
        pa.field("start_ns", pa.int64(), nullable=False),
        pa.field("end_ns", pa.int64(), nullable=False),
        pa.field("name", pa.string(), nullable=False, metadata={"doc": "module path (live) or class instance name (Kineto)"}),
        pa.field("phase", pa.string(), nullable=False, metadata={"doc": "forward | backward"}),
    ]
)

STEPS = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("start_ns", pa.int64(), nullable=False),
        pa.field("end_ns", pa.int64(), nullable=False),
        pa.field("name", pa.string(), nullable=False),
        pa.field("pid", pa.int64(), metadata={"doc": "process of the thread that ran the step (null: not known)"}),
        pa.field("tid", pa.int64(), metadata={"doc": "the thread that ran the step (ProfilerStep's, the training loop's); "
                                                     "ops of threads unrelated to it stay out of the step (null: no filter)"}),
    ]
)

SAMPLES = pa.schema(
    [
        pa.field("timestamp_ns", pa.int64(), nullable=False),
        pa.field("device", pa.int32(), nullable=False),
        pa.field("metric", pa.string(), nullable=False, metadata={"doc": "nvml.utilization.gpu, gpm.sm_active, ..."}),
        pa.field("value", pa.float64(), nullable=False),
    ]
)

# A live step's input signature (stitch.step_facts.StepFacts) that ends so is carried only once two successive
# measurements of it agree: a number passed to the model took too many values to stay in it, and may decide
# the work (capture.signature).
NEEDS_CONFIRMATION = "|confirm"

TABLE_SCHEMAS: dict[str, pa.Schema] = {
    "kernels": KERNELS,
    "launches": LAUNCHES,
    "external_correlation": EXTERNAL_CORRELATION,
    "ops": OPS,
    "modules": MODULES,
    "steps": STEPS,
    "samples": SAMPLES,
}


def empty_table(name: str) -> pa.Table:
    return TABLE_SCHEMAS[name].empty_table()


def table_from_columns(name: str, columns: dict[str, Any]) -> pa.Table:
    """Build a record table from python/numpy columns, filling absent nullable columns with nulls."""
    schema = TABLE_SCHEMAS[name]
    length = None
    for value in columns.values():
        length = len(value)
        break
    if length is None:
        return schema.empty_table()
    arrays = []
    for f in schema:
        if f.name in columns:
            value = columns[f.name]
            if isinstance(value, pa.ChunkedArray):
                value = value.combine_chunks()
            if isinstance(value, pa.Array):
                arrays.append(value if value.type == f.type else value.cast(f.type))
            else:
                arrays.append(pa.array(value, type=f.type))
        else:
            arrays.append(pa.nulls(length, type=f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


@dataclass
class DeviceInfo:
    """What the source knows about one GPU of the process."""

    ordinal: int
    name: str
    uuid: str | None = None
    sm_count: int | None = None
    memory_bytes: int | None = None
    # Everything the source reported (Kineto deviceProperties, NVML fields): hardware lookup uses it.
    properties: dict[str, Any] = field(default_factory=dict)


@dataclass
class RecordSet:
    """All record tables of one process (one rank), plus what is known about where it ran.

    ``resource`` holds OTel resource attributes already in their final names (service.name,
    host.name, process.pid, k8s.*, plasmient.job.id, plasmient.rank, ...); ``source`` names the
    input (file path or 'live:cupti'); ``clock`` says which clock the timestamps are on:
    'epoch' (Unix ns, exportable as is) or 'relative' (no epoch anchor was recorded).
    """

    kernels: pa.Table = field(default_factory=lambda: empty_table("kernels"))
    launches: pa.Table = field(default_factory=lambda: empty_table("launches"))
    external_correlation: pa.Table = field(default_factory=lambda: empty_table("external_correlation"))
    ops: pa.Table = field(default_factory=lambda: empty_table("ops"))
    modules: pa.Table = field(default_factory=lambda: empty_table("modules"))
    steps: pa.Table = field(default_factory=lambda: empty_table("steps"))
    samples: pa.Table = field(default_factory=lambda: empty_table("samples"))
    devices: list[DeviceInfo] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)
    source: str = ""
    clock: str = "epoch"
    # Counters the source wants on the step/rank span (e.g. CUPTI dropped records).
    counters: dict[str, int] = field(default_factory=dict)

    def tables(self) -> dict[str, pa.Table]:
        return {name: getattr(self, name) for name in TABLE_SCHEMAS}

    def validate(self) -> None:
        """Raise ValueError when a table does not match its schema (a source bug, not user input)."""
        for name, table in self.tables().items():
            expected = TABLE_SCHEMAS[name]
            if not table.schema.equals(expected, check_metadata=False):
                raise ValueError(f"record table {name!r} has schema {table.schema}, expected {expected}")
