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

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

LEVELS = ("fleet", "node", "rank", "step", "module", "op", "kernel")
ABOVE_STEP = ("fleet", "node", "rank", "step")
BOUNDS = ("compute", "memory", "latency", "communication", "idle", "unknown")
DEFAULT_BASELINE_MFU = 0.46  # PaLM's reported MFU, the DESIGN default for "not wasted"
# The largest device peak (TFLOP/s), bandwidth (GB/s) or price (USD an hour) a flag or variable may set: a
# larger one is a typo, and past ~1e296 TFLOP/s the peak overflows to inf and every MFU reads 0.
MAX_FLAG_VALUE = 1e9
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
    SpanAttribute("plasmient.gpus", _I, "{gpu}", _ALL, "devices the span's device window is charged for; absent when it has none"),
    SpanAttribute("plasmient.wall_s", _F, "s", _ALL, "end - start of the span as drawn: the CPU interval widened over its children"),
    SpanAttribute("plasmient.device.window_s", _F, "s", _ALL, "the device window every ratio of the span divides by: a kernel's own interval; op/module: first kernel start to last kernel end under it; step: from the previous step's last kernel end (first step: its CPU start) to its own last kernel end, so steps tile the device timeline (a pipelined step's first kernels may run in the previous step's window: they stay its own); rank: its step's; node/fleet: the extent of their ranks'. Absent when the span launched no device work"),
    SpanAttribute("plasmient.device.start_ns", _I, "ns", _ALL, "start of the device window (Unix epoch ns); the window ends at start + window_s"),
    SpanAttribute("plasmient.flops", _F, "{flop}", _ALL, "useful FLOPs of the kernels under the span whose FLOPs are known (total, inclusive); a parent's is the sum of its children's; absent (unknown, not 0) where that sum is 0 and some busy time ran work of unknown FLOPs"),
    SpanAttribute("plasmient.flops.self", _F, "{flop}", _ALL, "FLOPs of the span's own kernels, not under a child module/op span (exclusive); absent as plasmient.flops is, over those kernels. Own kernels are those under no exported child module/op span: what the span budget folds is its nearest exported ancestor's own, so a span's .self and its exported children add up to its total."),
    SpanAttribute("plasmient.flops.recompute", _F, "{flop}", _ALL, "FLOPs of forward work the backward pass recomputed (activation checkpointing) under the span: hardware work, not in plasmient.flops or plasmient.mfu, in plasmient.hfu; absent when there is none"),
    SpanAttribute("plasmient.hfu", _F, "1", _ALL, "hardware FLOPs utilization: (flops + flops.recompute) / (peak * window * gpus), PaLM's HFU; equals mfu without recompute, and is absent where mfu is"),
    SpanAttribute("plasmient.flops.coverage", _F, "1", _ALL, "share of the span's busy device time spent in kernels whose FLOPs are known (copies and collectives are a known zero); no MFU where it is 0, nor where it is below 1 and the known FLOPs are 0"),
    SpanAttribute("plasmient.flops.source", _S, "", ABOVE_STEP, "measured (FLOPs from the step's own ops) | carried (live step-depth step: flops, flops.recompute, ideal_s and flops.coverage of the latest full-depth step with the same input-shape signature, MFU over the step's own device window) | unknown (step-depth step with nothing to carry: no FLOPs, no MFU)"),
    SpanAttribute("plasmient.ideal_s", _F, "s", _ALL, "sum over kernels of flops / peak(dtype): time the work needs at peak; absent when the peak is unknown, or where plasmient.flops is"),
    SpanAttribute("plasmient.busy_s", _F, "s", _ALL, "device-seconds the kernels under the span held their devices, concurrent kernels sharing each second equally (additive: no device-second counts twice)"),
    SpanAttribute("plasmient.busy_s.self", _F, "s", _ALL, "busy_s of the span's own kernels (exclusive). Own kernels are those under no exported child module/op span: what the span budget folds is its nearest exported ancestor's own, so a span's .self and its exported children add up to its total."),
    SpanAttribute("plasmient.idle_s", _F, "s", ABOVE_STEP, "device-seconds of the step's window with no kernel of the rank resident, whichever step launched it (host gaps): part of wasted_s; over a rank, busy_s + idle_s = the windows' device-seconds"),
    SpanAttribute("plasmient.kernel_s", _F, "s", ABOVE_STEP, "summed durations of the kernels under the span (not a union: concurrent kernels each count)"),
    SpanAttribute("plasmient.comm.total_s", _F, "s", ABOVE_STEP, "device-seconds during which a collective of the span ran (union per device, summed over devices), each kernel whole"),
    SpanAttribute("plasmient.comm.exposed_s", _F, "s", ABOVE_STEP, "the part of comm.total_s during which no compute kernel (of any step) ran on the same device: communication not hidden behind compute (TraceLens's exposed_comm_time)"),
    SpanAttribute("plasmient.comm.overlap", _F, "1", ABOVE_STEP, "1 - comm.exposed_s / comm.total_s: the share of communication hidden behind compute (HTA's comp_comm_overlap_pctg / 100); absent without communication"),
    SpanAttribute("plasmient.comm.bytes", _F, "By", ("fleet", "node", "rank", "step", "kernel"), "collective kernel: its message size S as nccl-tests counts it, elements x dtype size from the NCCL metadata Kineto records (all_gather: the gathered output, reduce_scatter: the input, else the tensor); step/rank: the sum over the step's sized collectives; node/fleet: the sum over their ranks. Absent where no collective carried a size"),
    SpanAttribute("plasmient.comm.algbw_gbs", _F, "GBy/s", ("kernel",), "collective kernel: comm.bytes / kernel duration (nccl-tests algbw, 1e9 bytes/s)"),
    SpanAttribute("plasmient.comm.busbw_gbs", _F, "GBy/s", ("fleet", "node", "rank", "step", "kernel"), "collective kernel: algbw x nccl-tests bus factor (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n; broadcast, reduce, send, recv 1; n = process group size, absent for n < 2); step/rank/node/fleet: the bytes-weighted mean over its collectives, sum(bytes x busbw) / sum(bytes)"),
    SpanAttribute("plasmient.comm.busbw_fraction", _F, "1", ("fleet", "node", "rank", "step", "kernel"), "comm.busbw_gbs / comm.link_peak_gbs; absent when the device's link peak is unknown. Not capped: above 1 where the rank arrived last and found its peers' data already sent (see comm.over_link_peak)"),
    SpanAttribute("plasmient.comm.link_peak_gbs", _F, "GBy/s", ("fleet", "node", "rank", "step"), "the GPU's NVLink / Infinity Fabric bandwidth in one direction (datasheet total / 2), what busbw is compared against; on steps with collective kernels; absent for parts without a known GPU-to-GPU fabric"),
    SpanAttribute("plasmient.comm.unsized", _I, "{kernel}", ("rank", "step"), "collective kernels of the step whose record carried no usable message size (no NCCL metadata, unknown dtype or collective): not in comm.bytes"),
    SpanAttribute("plasmient.comm.over_link_peak", _I, "{kernel}", ("rank", "step"), "collective kernels of the step whose busbw exceeded the link peak (kept, not capped)"),
    SpanAttribute("plasmient.comm.slowest.collective", _S, "", ("rank", "step"), "c10d name of the step's longest-running collective with a known busbw"),
    SpanAttribute("plasmient.comm.slowest.bytes", _F, "By", ("rank", "step"), "its message size"),
    SpanAttribute("plasmient.comm.slowest.busbw_gbs", _F, "GBy/s", ("rank", "step"), "its bus bandwidth"),
    SpanAttribute("plasmient.comm.slowest.duration_s", _F, "s", ("rank", "step"), "its kernel duration"),
    SpanAttribute("plasmient.memcpy.total_s", _F, "s", ABOVE_STEP, "device-seconds during which a memcpy/memset of the span ran (union per device); copies of two steps running at once count in each"),
    SpanAttribute("plasmient.memcpy.exposed_s", _F, "s", ABOVE_STEP, "the part of memcpy.total_s with no compute kernel (of any step) running on the same device"),
    SpanAttribute("plasmient.memcpy.overlap", _F, "1", ABOVE_STEP, "1 - memcpy.exposed_s / memcpy.total_s; absent without copies"),
    SpanAttribute("plasmient.idle.host_s", _F, "s", ABOVE_STEP, "idle device-seconds with no kernel (of any step) launched and waiting: the host did not feed the device (part of idle_s); absent where none of the step's kernels has a launch record (live step-depth steps, traces without runtime events), and on node/fleet spans where a member's is absent"),
    SpanAttribute("plasmient.idle.device_s", _F, "s", ABOVE_STEP, "idle device-seconds with a kernel launched but not started: the device waited on a dependency, an event, another stream or rank (part of idle_s); absent where none of the step's kernels has a launch record (live step-depth steps, traces without runtime events), and on node/fleet spans where a member's is absent"),
    SpanAttribute("plasmient.launch_queue.mean", _F, "{kernel}", ABOVE_STEP, "the rank's kernels launched and not yet finished (whichever step launched them), time-averaged over the window; absent where none of the step's kernels has a launch record"),
    SpanAttribute("plasmient.launch_queue.max", _I, "{kernel}", ABOVE_STEP, "most of the rank's kernels launched and not yet finished at once in the window; absent where none of the step's kernels has a launch record"),
    SpanAttribute("plasmient.util.resident", _F, "1", _ALL, "resident time (union of the span's kernel intervals per device; step/rank and above: of every kernel of the rank in the window, whichever step launched it) / (window_s * gpus): what nvidia-smi utilization.gpu reports; absent where the window is 0 long (a kernel under the trace's clock resolution: 0/0)"),
    SpanAttribute("plasmient.mfu", _F, "1", _ALL, "ideal_s / (window_s * gpus): each kernel's flops over the peak of the precision it ran at (for one precision flops / (peak * window * gpus)); absent when the peak is unknown, flops.coverage is 0, or the known FLOPs are 0 while coverage < 1 (a bound of 0 says nothing); with partial coverage it counts only the known FLOPs (a lower bound)"),
    SpanAttribute("plasmient.stall_fraction", _F, "1", _ALL, "1 - ideal_s / busy_s: resident time that issued no useful math; absent when busy = 0, the peak is unknown, coverage is 0, or the known FLOPs are 0 while coverage < 1"),
    SpanAttribute("plasmient.idle_fraction", _F, "1", _ALL, "1 - util.resident (absent where it is)"),
    SpanAttribute("plasmient.bytes", _F, "By", _ALL, "bytes moved to/from device memory by the kernels under the span (model from op shapes, memcpy/memset sizes); absent where that sum is 0 and some busy time ran kernels whose bytes are unknown (a join's, a collective's, an unsized copy's)"),
    SpanAttribute("plasmient.bytes.self", _F, "By", _ALL, "bytes of the span's own kernels (exclusive); absent as plasmient.bytes is, over those kernels. Own kernels are those under no exported child module/op span: what the span budget folds is its nearest exported ancestor's own, so a span's .self and its exported children add up to its total."),
    SpanAttribute("plasmient.arithmetic_intensity", _F, "{flop}/By", _ALL, "FLOPs the hardware did per byte moved: (plasmient.flops + plasmient.flops.recompute) / bytes, as the roofline bound uses (a recomputed kernel does its arithmetic again); absent when bytes = 0, no FLOPs are known, or the known FLOPs are 0 while coverage < 1"),
    SpanAttribute("plasmient.bound", _S, "", _ALL, "compute | memory (need known FLOPs, bytes, peak and bandwidth: compute when the FLOPs at the peak of each kernel's precision take at least as long as the bytes at the memory bandwidth) | latency (kernels under 10 us) | communication (collectives) | idle (host gaps) | unknown; absent without device time"),
    SpanAttribute("plasmient.cost.usd", _F, "USD", _ALL, "price per device-hour * charged device-seconds / 3600 (steps and ranks: busy_s + idle_s, the window's device-seconds unless a pipelined step's work ran in its neighbour's window; nodes and fleet: their ranks' plus the device time in their extent outside every step window of a rank; below: busy_s); additive; absent when no price is known"),
    SpanAttribute("plasmient.cost.usd.self", _F, "USD", _ALL, "cost of the span's own kernels and, on a step, its idle gaps (exclusive). Own kernels are those under no exported child module/op span: what the span budget folds is its nearest exported ancestor's own, so a span's .self and its exported children add up to its total."),
    SpanAttribute("plasmient.cost.wasted_usd", _F, "USD", _ALL, "price per device-hour * wasted_s / 3600"),
    SpanAttribute("plasmient.cost.wasted_usd.self", _F, "USD", _ALL, "wasted_usd of the span's own kernels and idle gaps (exclusive). Own kernels are those under no exported child module/op span: what the span budget folds is its nearest exported ancestor's own, so a span's .self and its exported children add up to its total."),
    SpanAttribute("plasmient.wasted_s", _F, "s", _ALL, "device-seconds not shown to do baseline-MFU work: per kernel busy - ideal/baseline (all of it where FLOPs or peak are unknown), plus the idle gaps of steps and, on nodes/fleet, the device time in their extent outside every step window of a rank; additive, at most the device-seconds of the window plus a pipelined step's early work"),
    SpanAttribute("plasmient.wasted_s.self", _F, "s", _ALL, "wasted_s of the span's own kernels and idle gaps (exclusive): culprits are ranked by it. Own kernels are those under no exported child module/op span: what the span budget folds is its nearest exported ancestor's own, so a span's .self and its exported children add up to its total."),
    SpanAttribute("plasmient.kernels", _I, "{kernel}", _ALL, "device activities under the span (exported or folded): GPU kernels, copies and collectives; on a CPU the ops that stand for kernels and the stretches of an op's own work between its child ops"),
    SpanAttribute("plasmient.kernels.folded", _I, "{kernel}", ("fleet", "node", "rank", "step", "module", "op"), "kernels under the span that are not exported as spans (span budget), inclusive: on a step, every kernel of the step that is not a span"),
    SpanAttribute("plasmient.kernels.folded_s", _F, "s", ("fleet", "node", "rank", "step", "module", "op"), "summed duration of those kernels"),
    SpanAttribute("plasmient.kernels.folded_flops", _F, "{flop}", ("fleet", "node", "rank", "step", "module", "op"), "flops of those kernels (part of this span's flops); absent where they are 0 and some of those kernels' FLOPs are unknown"),
    SpanAttribute("plasmient.spans.folded", _I, "{span}", ("fleet", "node", "rank", "step", "module", "op"), "module and op spans under the span that are not exported (span budget), inclusive"),
    SpanAttribute("plasmient.input.dropped_events", _I, "{event}", ("step",), "on the first step of a rank: trace events dropped as impossible (negative or absurd times), counted by the source"),
    SpanAttribute("plasmient.input.clamped_events", _I, "{event}", ("step",), "on the first step of a rank: trace events whose times were clamped into range, and kernels recorded far before their launch (past the device clock's shift) moved to it"),
    SpanAttribute("plasmient.input.invalid_values", _I, "{value}", ("step",), "on the first step of a rank: other field values the source rejected (ids, sizes)"),
    SpanAttribute("plasmient.kernels.outside_steps", _I, "{kernel}", ("step",), "on the first step of a rank: kernels of the trace that belong to no step (launched before the first or after the last), in no span"),
    SpanAttribute("plasmient.ops.outside_steps", _I, "{op}", ("step",), "on the first step of a rank: ops of the trace that belong to no step (run before the first or after the last), in no span; on a CPU, where the ops are the work, what kernels.outside_steps is on a GPU"),
    SpanAttribute("plasmient.ops.other_threads", _I, "{op}", ("step",), "ops that ran inside the step on a thread unrelated to it (no step, nn.Module call, backward op, collective or forward op whose autograd node a backward ran on that thread: a user's background thread), left out of the step and its FLOPs as FlopCounterMode leaves them out; their kernels stay in the step's device time, without an op; absent where the steps name no thread (traces without ProfilerStep)"),
    SpanAttribute("plasmient.kernels.over_peak", _I, "{kernel}", ("step",), "kernels whose modelled flops exceed peak * duration (fewer multiplies run than modelled: Winograd, FFT); their ideal_s stays flops/peak, their own mfu is their util"),
    SpanAttribute("plasmient.unjoined_kernels", _I, "{kernel}", ("step",), "kernels with no launch or no op; kept, parented to the step"),
    SpanAttribute("plasmient.peak_flops", _F, "{flop}/s", ("rank", "step", "kernel"), "kernel (one with FLOPs): the dense peak of the precision its math ran at (fp32, tf32, 3xtf32, bf16, ...), its roof; above the step: the device's headline dense peak, bf16 tensor math on a GPU, fp32 on a CPU"),
    SpanAttribute("plasmient.fleet.ranks_missing", _I, "{rank}", ("fleet", "node"), "ranks of the job without this step in the numbers: live, whose summary had not arrived within PLASMIENT_FLEET_WAIT_S; ingested, input files that did not record the step"),
    SpanAttribute("plasmient.peak_bandwidth", _F, "By/s", ("rank", "step"), "memory bandwidth of the device (roofline slope)"),
    SpanAttribute("plasmient.collectives.matched", _I, "{collective}", ("fleet", "node"), "collectives seen on at least two of the ranks below (kernels of one name ending within 1 ms of each other, all started before any ended)"),
    SpanAttribute("plasmient.collectives.skew_max_s", _F, "s", ("fleet", "node"), "largest spread of the ranks' arrivals (collective kernel starts) at one collective"),
    SpanAttribute("plasmient.collectives.skew_mean_s", _F, "s", ("fleet", "node"), "mean spread of the ranks' arrivals over the matched collectives"),
    SpanAttribute("plasmient.straggler.rank", _I, "", ("fleet", "node"), "the rank that arrived last at the collectives most costly to the others"),
    SpanAttribute("plasmient.straggler.wait_s", _F, "s", ("fleet", "node"), "device-seconds the other ranks spent waiting in collectives for the straggler"),
    SpanAttribute("plasmient.peak.source", _S, "", ("rank",), "table:<model> | override | calibrated | unknown"),
    SpanAttribute("plasmient.clock.offset_ns", _I, "ns", ("rank",), "shift applied to GPU timestamps so no kernel starts before its launch"),
    SpanAttribute("plasmient.util.nvml", _F, "1", ("step",), "mean NVML utilization.gpu of the readings whose sample period (taken as 1 s) lies inside the step; absent on shorter steps (plasmient.util.resident is the exact per-step figure)"),
    SpanAttribute("plasmient.gpm.sm_active", _F, "1", ("step",), "GPM SM activity during the step"),
    SpanAttribute("plasmient.gpm.tensor_active", _F, "1", ("step",), "GPM tensor-pipe activity during the step"),
    SpanAttribute("plasmient.gpm.dram_bw_util", _F, "1", ("step",), "GPM DRAM bandwidth utilisation during the step"),
    SpanAttribute("plasmient.cupti.dropped_records", _I, "{record}", ("step",), "activity records CUPTI dropped during the step"),
    SpanAttribute("plasmient.sampled_depth", _S, "", ("step",), "full | step: whether the step carries its whole subtree"),
    SpanAttribute("plasmient.step.opened_at", _S, "", ("step",), "live capture: boundary | first_module_call: where the step opened. first_module_call: step 0, and the first step after an explicit one (an eval loop in `with plasmient_trace.step()`), open at their first nn.Module call, so what ran before that call (a projection outside the model, zero_grad) is in no step and in none of its FLOPs; such a step's signature is its own, so it carries FLOPs only to and from steps opened the same way; absent on ingested traces"),
    SpanAttribute("plasmient.culprit.module", _S, "", ABOVE_STEP, "module pattern of the first culprit row (layer numbers as *); outside every module, the optimizer step scope (Optimizer.step#…) that ran its op"),
    SpanAttribute("plasmient.culprit.op", _S, "", ABOVE_STEP, "launching op of the first culprit row"),
    SpanAttribute("plasmient.culprit.kernel", _S, "", ABOVE_STEP, "kernel name of the first culprit row ('[device idle]' for host gaps)"),
    SpanAttribute("plasmient.culprit.rank", _I, "", ("fleet", "node"), "rank losing the most time to the first culprit row"),
    SpanAttribute("plasmient.culprit.wasted_s", _F, "s", ABOVE_STEP, "exclusive wasted device-seconds of the first culprit row"),
    SpanAttribute("plasmient.culprit.bound", _S, "", ABOVE_STEP, "bound of the first culprit row"),
    SpanAttribute("plasmient.culprit.suggestion", _S, "", ABOVE_STEP, "one-line suggestion for the first culprit row"),
    SpanAttribute("plasmient.culprits", _S, "", ABOVE_STEP, "JSON list of the culprit rows, most exclusive waste first: {kernel, op, module, calls, layers, wasted_s, bound, kind, suggestion[, rank][, lower_bound]}; kernels grouped by name, op and module pattern across layers, plus the idle row. Step and rank spans: the step's top 10. Node and fleet spans: their ranks' rows summed before any cut, up to 512, so rows summed again (over steps) stay whole. lower_bound: true marks a row a list it was summed from may have left out (see culprits.left_out_s): its wasted_s is at least that"),
    SpanAttribute("plasmient.culprits.left_out_s", _F, "s", ABOVE_STEP, "the most exclusive waste any culprit row not in plasmient.culprits may hold: 0 when the list names every row that wasted time; absent where unknown"),
    SpanAttribute("plasmient.module.path", _S, "", ("module",), "nn.Module path (live) or nesting of class instances (Kineto)"),
    SpanAttribute("plasmient.module.phase", _S, "", ("module",), "forward | backward"),
    SpanAttribute("plasmient.op.external_id", _I, "", ("op",), "Kineto External id / CUPTI external correlation id"),
    SpanAttribute("plasmient.op.sequence_number", _I, "", ("op",), "autograd sequence number"),
    SpanAttribute("plasmient.op.input_dims", _S, "", ("op",), "JSON list of input shapes"),
    SpanAttribute("plasmient.op.input_types", _S, "", ("op",), "JSON list of input dtypes"),
    SpanAttribute("plasmient.op.dtype", _S, "", ("op",), "dtype the peak was looked up for"),
    SpanAttribute("plasmient.op.flops_model", _S, "", ("op",), "gemm | conv | attention | norm | softmax | elementwise | embedding | reduction | view (shape-only: a known zero) | none (unknown)"),
    SpanAttribute("plasmient.op.model_flops", _F, "{flop}", ("op",), "flops the shape model gives this op alone (before attribution to kernels); absent where the op has no model (flops_model none)"),
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
    SpanAttribute("plasmient.kernel.capture_op", _S, "", ("kernel",), "CUDA/HIP graph replay: the op that launched this kernel when the graph was captured"),
    SpanAttribute("plasmient.kernel.capture_module", _S, "", ("kernel",), "CUDA/HIP graph replay: module path of that capture-time op"),
)

ATTRIBUTE_BY_NAME = {a.name: a for a in SPAN_ATTRIBUTES}

# Shares (unit "1") that are not capped at 1: bus bandwidth over the link peak exceeds it where a rank arrived
# last and found its peers' data already sent.
UNCAPPED_SHARES = frozenset({"plasmient.comm.busbw_fraction"})


def value_range(attribute: SpanAttribute) -> tuple[float, float] | None:
    """The values a numeric attribute can take as plasmient computes it: a share (unit "1") lies in [0, 1],
    every other amount with a unit is at least 0; None where the sign carries meaning (a clock offset, an
    epoch time in ns) or the value is a label or id (no unit)."""
    if attribute.type == _S or attribute.unit in ("", "ns"):
        return None
    if attribute.unit == "1" and attribute.name not in UNCAPPED_SHARES:
        return (0.0, 1.0)
    return (0.0, float("inf"))

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
# Each span column's name, type, nullability and the number of its type among the distinct ones, read once:
# every group of steps assembles two tables, and a pa.Field builds a new Python object per property read.
_SPAN_TYPES = list(dict.fromkeys(f.type for f in SPAN_TABLE_SCHEMA))
_SPAN_FIELDS = [(f.name, f.type, f.nullable, _SPAN_TYPES.index(f.type)) for f in SPAN_TABLE_SCHEMA]

# Resource attribute keys we set. OTel semantic-convention names where they exist.
RESOURCE_ATTRIBUTES: dict[str, str] = {
    "service.name": "OTEL_SERVICE_NAME, else 'plasmient-trace'",
    "service.instance.id": "job/rank, unique per process",
    "host.name": "node the rank ran on (a Kineto file names none: node-<rank // --ranks-per-node>, a stand-in)",
    "process.pid": "pid of the traced process",
    "k8s.namespace.name": "Kubernetes downward API (POD_NAMESPACE / K8S_NAMESPACE)",
    "k8s.pod.name": "Kubernetes downward API (POD_NAME / K8S_POD_NAME)",
    "k8s.node.name": "Kubernetes downward API (NODE_NAME / K8S_NODE_NAME)",
    "plasmient.job.id": "--job-id / PLASMIENT_JOB_ID, else SLURM_JOB_ID with .SLURM_STEP_ID and -restartN "
                        "(SLURM_RESTART_COUNT) when set, else TORCHELASTIC_RUN_ID unless torchrun's default 'none' "
                        "(-restartN after TORCHELASTIC_RESTART_COUNT restarts); "
                        "live, with none of these: rank 0's host-pid-time, shared with the other ranks through the "
                        "process group's store",
    "plasmient.rank": "global rank (distributedInfo.rank, RANK, SLURM_PROCID; an ingested file with none: its position among the inputs)",
    "plasmient.world_size": "world size (distributedInfo.world_size, WORLD_SIZE, SLURM_NTASKS)",
    "plasmient.local_rank": "LOCAL_RANK / SLURM_LOCALID",
    "plasmient.gpu.model": "the hardware table's name of the GPU whose peaks the metrics use (H100 SXM); absent "
                           "when no table names the device (a user-given peak alone)",
    "plasmient.gpu.model.reported": "the device name as the trace or the driver reports it",
    "plasmient.cpu.model": "CPU-only ranks: the CPU's name and the thread count its peak was calibrated for",
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
    # The stitcher's per-(step, rank) reductions (stitch.fleet.RankSummary) behind the rank spans, when the
    # batch came from the stitcher: what live multi-rank capture exchanges to build fleet/node spans.
    summaries: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return self.table.num_rows

    def trace_ids(self) -> list[bytes]:
        return sorted(set(self.table.column("trace_id").to_pylist()))


def upper_spans(batch: SpanBatch) -> SpanBatch:
    """The fleet, node, rank and step spans of a batch (all the terminal summary reads), with its resources.
    Copied out, so the batch's buffers can be freed."""
    keep = pc.is_in(batch.table.column("plasmient.level"), value_set=pa.array(ABOVE_STEP))
    table = batch.table.filter(keep)
    return SpanBatch(table=table.combine_chunks(), resources=batch.resources, summaries=batch.summaries)


def empty_span_table() -> pa.Table:
    return SPAN_TABLE_SCHEMA.empty_table()


def span_table_from_columns(columns: dict[str, Any], length: int) -> pa.Table:
    """Assemble a span table; absent attribute columns become all-null."""
    arrays = []
    # one all-null array per type, shared by every absent column of that type (arrays are immutable): a
    # fresh one per column would allocate and zero its buffers, some 60 of them on a table of kernel spans
    nulls: list[pa.Array | None] = [None] * len(_SPAN_TYPES)
    for name, type_, nullable, type_number in _SPAN_FIELDS:
        value = columns.get(name)
        if value is None:
            if not nullable:
                raise ValueError(f"span column {name} is required")
            if nulls[type_number] is None:
                nulls[type_number] = pa.nulls(length, type=type_)
            arrays.append(nulls[type_number])
        elif isinstance(value, (pa.Array, pa.ChunkedArray)):
            value = value.cast(type_) if value.type != type_ else value
            arrays.append(value.combine_chunks() if isinstance(value, pa.ChunkedArray) else value)
        else:
            arrays.append(pa.array(value, type=type_))
    return pa.Table.from_arrays(arrays, schema=SPAN_TABLE_SCHEMA)


def with_nulls(values: np.ndarray, null: np.ndarray) -> pa.Array:
    """``pa.array(values, mask=null)`` for int/float numpy values: the validity bitmap made with one
    ``np.packbits`` instead of Arrow's loop over the mask (5% of a stitch at 10^5 kernels); the values
    buffer is shared, not copied. Other dtypes go through ``pa.array``."""
    values = np.asarray(values)
    null = np.asarray(null, bool)
    if values.dtype.kind not in "iuf" or values.ndim != 1 or null.shape != values.shape:
        return pa.array(values, mask=null)
    if len(values) <= _ARROW_MASK_ROWS:  # Arrow's loop costs less than the buffers' set-up on a few rows
        return pa.array(values, mask=null)
    if not values.flags.c_contiguous:
        values = np.ascontiguousarray(values)
    nulls = int(np.count_nonzero(null))
    bitmap = None if nulls == 0 else pa.py_buffer(np.packbits(~null, bitorder="little"))
    type_ = _ARROW_OF_NUMPY.get(values.dtype)
    if type_ is None:
        type_ = _ARROW_OF_NUMPY[values.dtype] = pa.from_numpy_dtype(values.dtype)
    return pa.Array.from_buffers(type_, len(values), [bitmap, pa.py_buffer(values)], null_count=nulls)


# Up to this many rows, with_nulls leaves the bitmap to pa.array (the same array: a fleet or node span table
# has a row or two a step, and with_nulls runs on each of its ~30 number columns a group of steps).
_ARROW_MASK_ROWS = 256
# numpy dtype -> its Arrow type, looked up once per dtype (with_nulls runs some 80 times per group of steps)
_ARROW_OF_NUMPY: dict[np.dtype, pa.DataType] = {}


def nan_to_null(values: np.ndarray) -> pa.Array:
    """float64 values with NaN and infinities as nulls (an unknown number is absent, never a number)."""
    values = np.asarray(values, np.float64)
    return with_nulls(values, ~np.isfinite(values))


def numbers_on_rows(values: np.ndarray, rows: np.ndarray, n: int) -> pa.Array:
    """An n-row int/float array holding values[k] on row rows[k] (rows distinct), null elsewhere and where a float is
    NaN or infinite. For the columns only a few rows carry (step and rank spans): no n-row temporaries
    beyond the zeroed result and its bitmap."""
    values = np.asarray(values)
    rows = np.asarray(rows, np.int64)
    if values.dtype.kind == "f":
        known = np.isfinite(values)
        values, rows = values[known], rows[known]
    data = np.zeros(n, values.dtype)
    data[rows] = values
    null = np.ones(n, bool)
    null[rows] = False
    return with_nulls(data, null)


def scatter_rows(values: pa.Array, rows: np.ndarray, n: int) -> pa.Array:
    """An n-row array holding values[k] on row rows[k] (rows increasing), null elsewhere.

    Not ``values.take(index with nulls)``: for strings Arrow reserves the values' mean length times n
    bytes (126 MB for the few culprit lists of a 33k-span table)."""
    if len(rows) == n:  # increasing rows on every row: the values are the column (a step's fleet and node spans)
        return values
    valid = np.zeros(n, bool)
    valid[rows] = values.is_valid().to_numpy(zero_copy_only=False)
    if not (pa.types.is_string(values.type) or pa.types.is_binary(values.type)):
        where = np.zeros(n, np.int64)
        where[rows] = np.arange(len(rows))
        return values.take(pa.array(where, mask=~valid))
    values = pa.concat_arrays([values]) if values.offset else values  # offsets from 0
    lengths = np.zeros(n, np.int32)
    offsets = np.frombuffer(values.buffers()[1], np.int32)[: len(values) + 1]
    lengths[rows] = np.diff(offsets)
    out_offsets = np.zeros(n + 1, np.int32)
    np.cumsum(lengths, out=out_offsets[1:])
    # rows increase with k, so the values' bytes are already in row order
    data = values.buffers()[2] or pa.py_buffer(b"")
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little"))
    return pa.Array.from_buffers(values.type, n, [bitmap, pa.py_buffer(out_offsets), data],
                                 null_count=n - int(valid.sum()))


def rows_of(table: pa.Table, rows: np.ndarray, max_runs: int = 64, take_below: int = 0) -> pa.Table:
    """The table's rows in the order given. Rows that form a few ascending runs (a step group's records, a
    grouped chunk of spans) are zero-copy slices, so a column is copied only if it is read; more than
    ``max_runs`` runs, or a broken-up selection of at most ``take_below`` rows, are gathered by one take."""
    if not len(rows):
        return table.slice(0, 0)
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    if len(breaks) > max_runs or (len(breaks) and len(rows) <= take_below):
        return table.take(pa.array(rows, pa.int64()))
    bounds = [0, *breaks.tolist(), len(rows)]
    runs = [table.slice(int(rows[a]), b - a) for a, b in zip(bounds[:-1], bounds[1:])]
    return runs[0] if len(runs) == 1 else pa.concat_tables(runs)
