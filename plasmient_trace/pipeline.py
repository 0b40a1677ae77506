"""The one pipeline every entry point runs: records -> costs and device specs -> stitch -> SpanBatch.

`ingest_stream` is the offline path (Kineto files): its spans come a group of steps at a time, whole traces
each (`ingest_paths` collects them into one batch). Live capture builds RecordSets itself and calls
`stitch_records`, so both share the joins, metrics and exporters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .conventions import DEFAULT_BASELINE_MFU, SpanBatch
from .memory import LARGE_ROWS, return_freed_memory
from .metrics import cpu_peak
from .metrics import flops as flops_model
from .metrics import hardware
from .records import RecordSet
from .sources.graph_capture import (
    capture_trace_for,
    launch_kernel_names,
    pair_graph_capture,
)
from .sources.kineto import TraceFormatError, read_kineto
from .sources.rawinput import repeated_input
from .sources.parallel import read_many
from .stitch.align import apply_offsets, estimate_alignment
from .stitch.fleet import merge_span_batches
from .stitch.joins import JoinedRank, op_parents
from .stitch.tree import (
    DEFAULT_MAX_SPANS,
    DeviceSpec,
    RankInput,
    StitchOptions,
    StreamTotals,
    stitch_stream,
)


@dataclass
class IngestOptions:
    job_id: str = "default"
    max_spans: int = DEFAULT_MAX_SPANS
    baseline_mfu: float = DEFAULT_BASELINE_MFU
    peak_tflops: float | None = None       # override the dense peak (TFLOP/s, for the op dtype)
    bandwidth_gbs: float | None = None
    gpu_price: float | None = None         # USD per GPU-hour
    # USD an hour of a CPU-only rank's cores where no CPU spec (cpu_spec) carries one: a live job's price does
    # not wait for the peak's calibration; offline it is PLASMIENT_CPU_PRICE, else None (no cost)
    cpu_price: float | None = None
    gpu_model: str | None = None           # name to look up when the trace names no device
    ranks_per_node: int = 8
    host: str | None = None
    service_name: str | None = None
    full_depth_steps: set[int] | None = None
    extra_resource: dict[str, Any] = field(default_factory=dict)
    # Spec used when a rank ran on the CPU only (live capture calibrates one; offline traces leave it unknown).
    cpu_spec: Any = None
    # The threads cpu_spec was calibrated with (its cache entry, should an op show the peak too low); None: this
    # process's torch threads. A live job's batch process has no torch of its own: the job's count comes along.
    cpu_threads: int | None = None
    # Trace of the CUDA/HIP graph capture a single replay input replays (None: look for execution_details.json).
    graph_capture: str | Path | None = None
    # Processes that parse the input files (one file per rank); 1 = in this process.
    workers: int = 1
    # Ranks that share each trace when they are stitched apart (live multi-rank): the span budget is split
    # between them. 0 = the ranks stitched together here.
    world_size: int = 0
    # Expert shape from the model's config.json (--model-config): costs MoE expert ops, unknown without it.
    moe: Any = None
    # Run the ranks as tasks on Ray (plasmient_trace.ranks): None = off, "" = a local Ray started here,
    # else the address of a running cluster.
    ray: str | None = None
    # Multi-rank ingest in workers: bring every rank's record tables back (IngestResult.records, for
    # Parquet). False leaves them in the workers, so the parent holds only spans.
    keep_records: bool = True
    # Live capture's per-step facts (stitch.step_facts.StepFacts); None: every step measured at full depth.
    step_facts: Any = None
    # Records stitched at once (stitch.chunks): memory holds one group of steps' spans. None: a share of
    # the input (stitch.inputs.default_chunk_rows).
    chunk_rows: int | None = None
    # Build the fleet and node spans from these ranks' summaries. False where they are built elsewhere from
    # every rank's (live multi-rank: capture.distributed gathers them through the c10d store).
    top_spans: bool = True


@dataclass
class IngestResult:
    batch: SpanBatch
    records: list[RecordSet]
    joined: list[JoinedRank]
    stats: dict[str, Any]
    summaries: list[Any] = field(default_factory=list)  # stitch.fleet.RankSummary per (step, rank)


def _main_device_props(records: RecordSet) -> dict[str, Any] | None:
    if not records.devices:
        return None
    kernels = records.kernels
    ordinal = records.devices[0].ordinal
    if kernels.num_rows:
        values, counts = np.unique(kernels.column("device").to_numpy(), return_counts=True)
        ordinal = int(values[np.argmax(counts)])
    for dev in records.devices:
        if dev.ordinal == ordinal:
            return dev.properties or {"name": dev.name}
    return records.devices[0].properties or {"name": records.devices[0].name}


def resolve_device(records: RecordSet, options: IngestOptions) -> DeviceSpec:
    """The peak/bandwidth/price that apply to this rank, honest about what is unknown."""
    on_cpu = records.kernels.num_rows == 0
    if on_cpu:
        spec = options.cpu_spec
        device_type = "cpu"
    else:
        props = _main_device_props(records)
        if options.gpu_model:
            props = {**(props or {}), "name": options.gpu_model}
        spec = hardware.lookup(props) if props else None
        device_type = "gpu"
    spec = hardware.apply_overrides(spec, peak_tflops=options.peak_tflops, bandwidth_gbs=options.bandwidth_gbs,
                                    price=options.gpu_price)
    price = options.gpu_price if spec is None else spec.price_per_hour
    if on_cpu and price is None:  # a CPU's price is the job's (PLASMIENT_CPU_PRICE), whether or not a peak is known
        price = options.cpu_price
    if spec is None:
        return DeviceSpec(model=None, device_type=device_type, peak_for=None, bandwidth=None,
                          price_per_hour=price, source="unknown")
    return DeviceSpec(model=spec.model, device_type=device_type, peak_for=spec.peak_flops, native=frozenset(spec.peak),
                      bandwidth=spec.memory_bandwidth, price_per_hour=price, source=spec.source)


def _observed_cpu_rates(records: RecordSet, costs: Any) -> dict[str, float]:
    """The FLOP/s recorded ops show, per dtype, as ``cpu_peak.evidence_rates`` takes it from ops long enough
    to time and fast enough to agree (on a CPU the op's interval is its kernel).

    Only ops that own their FLOPs count: an op that yields them to a same-class op inside it did not do
    that math at its own dtype. Under CPU autocast, aten::linear is recorded with its fp32 inputs around
    the bf16 aten::linear that does the work, and its "fp32 rate" is the bf16 GEMM's (1.8x the fp32 peak
    measured here), which used to raise, and cache, the fp32 peak."""
    if not records.ops.num_rows:
        return {}
    dur = (records.ops.column("end_ns").to_numpy() - records.ops.column("start_ns").to_numpy()) / 1e9
    flops = np.asarray(costs.flops, np.float64)
    owns = ~flops_model.yields_flops(op_parents(records.ops), costs.model, flops)
    ok = (flops > 0) & owns
    dtype = costs.dtype
    return cpu_peak.evidence_rates(flops[ok], dur[ok], dtype.names[dtype.codes[ok]])


def rank_input(records: RecordSet, options: IngestOptions, notes: list[str] | None = None) -> RankInput:
    costs = flops_model.coded_model_ops(records.ops, options.moe)
    if records.kernels.num_rows == 0 and options.cpu_spec is not None:
        # A calibrated CPU peak that a recorded op beat by more than 5% is wrong: raise it (said once, as a note).
        options.cpu_spec = hardware.raise_cpu_peak(options.cpu_spec, _observed_cpu_rates(records, costs),
                                                   threads=options.cpu_threads,
                                                   say=(notes.append if notes is not None else lambda _: None))
    inp = RankInput(
        records=records, spec=resolve_device(records, options),
        op_flops=np.asarray(costs.flops, np.float64), op_bytes=np.asarray(costs.bytes, np.float64),
        op_dtype=costs.dtype, op_model=costs.model,
    )
    if notes is not None and inp.spec.price_per_hour is None:
        if inp.spec.device_type == "cpu":  # not a default per thread: the trace does not say the job's threads
            notes.append("a CPU's price is not in its trace: no cost on its spans (set PLASMIENT_CPU_PRICE, "
                         "USD an hour of the job's cores)")
        elif inp.spec.model not in (None, "user-specified"):
            notes.append(f"{inp.spec.model} has no public list price: no cost on its spans (give one with --gpu-price)")
    if records.ops.num_rows >= LARGE_ROWS:
        return_freed_memory()
    return inp


def stitch_options(options: IngestOptions) -> StitchOptions:
    return StitchOptions(
        job_id=options.job_id, max_spans=options.max_spans, baseline_mfu=options.baseline_mfu,
        ranks_per_node=options.ranks_per_node, host=options.host, service_name=options.service_name,
        world_size=options.world_size, step_facts=options.step_facts,
        full_depth_steps=options.full_depth_steps, extra_resource=dict(options.extra_resource),
        chunk_rows=options.chunk_rows,
    )


@dataclass
class IngestStream:
    """An ingest whose spans arrive a group of steps at a time (``stitch.tree.stitch_stream``), each part
    holding whole traces, so a consumer that writes each part and lets it go holds one group's spans.
    ``stats`` and ``summaries`` are complete once ``parts`` is exhausted."""

    parts: Iterator[SpanBatch]
    records: list[RecordSet]
    stats: dict[str, Any]
    summaries: list[Any] = field(default_factory=list)
    joined: list[JoinedRank] = field(default_factory=list)

    def collect(self) -> IngestResult:
        """Every part in one batch (what ``stitch_records`` returns)."""
        parts = list(self.parts)
        batch = merge_span_batches(parts) if len(parts) != 1 else parts[0]
        batch.summaries = self.summaries
        return IngestResult(batch=batch, records=self.records, joined=self.joined, stats=self.stats,
                            summaries=self.summaries)


def input_label(records: RecordSet, index: int) -> str:
    """How messages name an input: its file, else its position."""
    return records.source or f"input {index}"


def stream_records(record_sets: list[RecordSet], options: IngestOptions,
                   progress: Callable[[str, int, int], None] | None = None) -> IngestStream:
    alignment = None
    if len(record_sets) > 1:
        # Ranks on different hosts have different clocks: align them on their collectives first.
        alignment = estimate_alignment(record_sets)
        record_sets = apply_offsets(record_sets, alignment.offsets)
    notes: list[str] = []
    inputs = [rank_input(r, options, notes) for r in record_sets]
    stats: dict[str, Any] = {"notes": notes}
    if alignment is not None:
        stats["clock_offsets_ns"] = alignment.offsets
        stats["clock_alignment"] = alignment.method
        from .ranks import input_lines

        stats["clock_notes"], stats["warnings"] = input_lines(
            alignment, [input_label(r, i) for i, r in enumerate(record_sets)],
            [set(r.steps.column("step").to_pylist()) for r in record_sets])
    stats["unknown_devices"] = [input_label(r, i) for i, (r, inp) in enumerate(zip(record_sets, inputs))
                                if inp.spec.source == "unknown"]
    stats["unknown_device_types"] = sorted({inp.spec.device_type for inp in inputs if inp.spec.source == "unknown"})
    stream = IngestStream(parts=iter(()), records=record_sets, stats=stats)

    def parts() -> Iterator[SpanBatch]:
        totals = StreamTotals()
        for part in stitch_stream(inputs, stitch_options(options), with_top_spans=options.top_spans,
                                  on_groups=_groups_progress(progress)):
            stream.joined = part.joined
            totals.add(part)
            yield part.batch
        stream.summaries = totals.summaries()
        stats.update(totals.stats(stream.joined))

    stream.parts = parts()
    return stream


def _groups_progress(progress: Callable[[str, int, int], None] | None) -> Callable[[int, int], None] | None:
    if progress is None:
        return None
    return lambda done, total: progress(f"stitched {done} of {total} step groups", done, total)


def stitch_records(record_sets: list[RecordSet], options: IngestOptions) -> IngestResult:
    return stream_records(record_sets, options).collect()


def pair_capture(path: Path, records: RecordSet, options: IngestOptions) -> tuple[RecordSet, str | None]:
    """Pair a CUDA/HIP graph replay with its capture trace, when it has one; the note that says how well."""
    capture = Path(options.graph_capture) if options.graph_capture is not None else capture_trace_for(path)
    if capture is None or _same_file(capture, path):
        return records, None  # the capture trace ingested itself: nothing is replayed in it
    records, pairing = pair_graph_capture(records, read_kineto(capture), launch_kernel_names(capture), options.moe)
    return records, (f"{path.name}: {pairing['paired']} of {pairing['graph_kernels']} replayed graph kernels paired "
                     f"with their capture-time ops in {capture.name}"
                     + (f"; {pairing['name_mismatches']} kernel names did not match and stay unknown"
                        if pairing["name_mismatches"] else ""))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def ingest_stream(
    paths: Iterable[str | Path],
    options: IngestOptions,
    progress: Callable[[str, int, int], None] | None = None,
) -> IngestStream:
    """Read every file (one per rank), then stitch them into one trace per step, a group of steps at a time.

    With several files and workers > 1, or on Ray, the ranks run as map tasks (``ranks.ingest_ranks``),
    giving the same spans in one part; otherwise everything runs in this process."""
    paths = [Path(p) for p in paths]
    if options.graph_capture is not None and len(paths) != 1:
        raise ValueError("--graph-capture pairs one replay trace with its capture: pass a single input")
    repeated = repeated_input(paths) if len(paths) > 1 else None
    if repeated:
        raise TraceFormatError(f"{repeated}: each rank's trace once, or its numbers count twice")
    # A calibrated CPU spec is raised rank after rank (rank_input), an order only one process keeps.
    if options.cpu_spec is None and (options.ray is not None or (options.workers > 1 and len(paths) > 1)):
        from .ranks import ingest_ranks

        result = ingest_ranks(paths, options, progress=progress)
        return IngestStream(parts=iter([result.batch]), records=result.records, stats=result.stats,
                            summaries=result.summaries, joined=result.joined)
    record_sets = []
    notes = []
    parsed = read_many(paths, workers=options.workers, progress=progress)
    for path, records in zip(paths, parsed):
        records, note = pair_capture(path, records, options)
        if note:
            notes.append(note)
        record_sets.append(records)
    if progress:
        progress("stitching", len(paths), len(paths))
    stream = stream_records(record_sets, options, progress)
    stream.stats["notes"] = notes + stream.stats["notes"]
    return stream


def ingest_paths(
    paths: Iterable[str | Path],
    options: IngestOptions,
    progress: Callable[[str, int, int], None] | None = None,
) -> IngestResult:
    """``ingest_stream`` with every part in one batch."""
    return ingest_stream(paths, options, progress).collect()
