"""The `plasmient` command: ingest, link, report, run, replay.

Errors a user can cause (bad trace file, unreachable collector, bad flags) print one line and exit
non-zero; they never show a traceback. Exit status 2 = bad input, 1 = export failed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import __version__
from .messages import OneLineErrorParser, one_printable_line, say_error

EXIT_BAD_INPUT = 2
EXIT_EXPORT_FAILED = 1
# The reader of our stdout went away (`| head`): what a shell reports for a program SIGPIPE ended (128 + 13),
# as `cat` gives; never 1, which `diff` uses for "MFU dropped", nor 0, which would pass a gate not evaluated.
EXIT_PIPE_CLOSED = 141


def stdin_for_dash(paths: Sequence[str], example: str) -> list[str]:
    """``-`` as /dev/stdin. A terminal there would wait, with nothing on the screen, for a trace to be typed:
    that is refused in one line (ValueError), naming the pipe that was meant (``example``); so is ``-`` twice
    (the second would read what the first left: nothing)."""
    if list(paths).count("-") > 1:
        raise ValueError("-: given twice, but stdin can be read only once")
    if "-" in paths and sys.stdin is not None and sys.stdin.isatty():
        raise ValueError(f"-: stdin is a terminal, not a file: pipe one in ({example}) or name the file")
    return ["/dev/stdin" if p == "-" else p for p in paths]


# The largest integer a JSON reader keeps exactly (a report embeds --fleet-gpus in its page: 2^64 was a traceback).
MAX_INT_FLAG = 2**53


def _positive_int(text: str) -> int:
    value = int(text)
    if not 0 < value <= MAX_INT_FLAG:
        raise argparse.ArgumentTypeError(f"must be a positive integer up to 2^53, not {text!r}")
    return value


def _step_number(text: str) -> int:
    """A step as trace ids name it: ProfilerStep#N and live steps count from 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a step number: {text!r}") from None
    if not 0 <= value <= MAX_INT_FLAG:
        raise argparse.ArgumentTypeError(f"steps are numbered from 0 (ProfilerStep#N), not {text!r}")
    return value


def _gpu_model(text: str) -> str:
    """A name the hardware table knows: a typo made ingest drop the device the trace named, exit 0, no MFU."""
    from .metrics.hardware import SPECS, knows_name

    if not knows_name(text):
        raise argparse.ArgumentTypeError(f"{text!r} is none of {', '.join(SPECS)} (nor a device name a trace "
                                         "records for one); set --peak-tflops for a device the table lacks")
    return text


def _output_path(text: str) -> str:
    """An output path: an empty one (an unset shell variable, `--parquet "$OUT"`) was taken as no output, exit 0."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: name the file or folder to write")
    return text


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _positive_float(text: str) -> float:
    value = _number(text)
    from .conventions import MAX_FLAG_VALUE

    if not 0 < value <= MAX_FLAG_VALUE:  # NaN and inf fail here too
        raise argparse.ArgumentTypeError(f"must be a positive number up to {MAX_FLAG_VALUE:g}, not {text!r}")
    return value


def _fraction(text: str) -> float:
    """An MFU: in (0, 1]."""
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], not {text!r}")
    return value


def _default_job_id() -> str | None:
    from .sources.resource import job_id_from_env

    return job_id_from_env(os.environ)


def add_stitch_arguments(p: argparse.ArgumentParser) -> None:
    from .stitch.inputs import CHUNK_ROWS_AMORTISED, CHUNK_ROWS_CAP, CHUNK_ROWS_FLOOR, GROUPS_PER_INPUT
    from .stitch.tree import DEFAULT_MAX_SPANS

    p.add_argument("--job-id", default=_default_job_id(), help="job id the trace ids derive from (default: $PLASMIENT_JOB_ID, $SLURM_JOB_ID.$SLURM_STEP_ID, $TORCHELASTIC_RUN_ID, else the first file's name, or the directory's)")
    p.add_argument("--max-spans", type=_positive_int, default=DEFAULT_MAX_SPANS, help=f"span budget per trace; above it the least wasteful kernels are folded into their op (default {DEFAULT_MAX_SPANS})")
    p.add_argument("--peak-tflops", type=_positive_float, help="override the device's dense peak, TFLOP/s")
    p.add_argument("--bandwidth-gbs", type=_positive_float, help="override the device's memory bandwidth, GB/s")
    p.add_argument("--gpu-price", type=_positive_float, help="USD per GPU-hour (default: the hardware table's list price)")
    p.add_argument("--gpu-model", type=_gpu_model, help="GPU model to assume instead of the trace's: a device name (e.g. 'NVIDIA A100-SXM4-80GB') "
                                       "or a hardware-table model (e.g. 'H100 SXM')")
    p.add_argument("--baseline-mfu", type=_fraction, default=None, help="MFU counted as not wasted (default 0.46)")
    p.add_argument("--ranks-per-node", type=_positive_int, default=8, help="ranks per node when the trace names no host (default 8)")
    p.add_argument("--host", help="host name to record for a single-host ingest")
    p.add_argument("--workers", type=_positive_int, default=None,
                   help="processes that read and stitch the ranks (one file per rank), each rank a task; the fleet "
                        "and node spans are built from the ranks' step summaries. Same output as 1, which stitches "
                        "in this process (default: with several files, one per file, at most one per CPU)")
    p.add_argument("--chunk-rows", type=_positive_int, default=None, metavar="N",
                   help="records (modules + ops + kernels, all ranks) stitched and written at once: memory holds one "
                        "group of whole steps, not the file; the output is the same (default: 1/"
                        f"{GROUPS_PER_INPUT} of the input's, between {CHUNK_ROWS_FLOOR:,} and {CHUNK_ROWS_CAP:,}, and "
                        f"up to {CHUNK_ROWS_AMORTISED:,} where that is at most a quarter of the input)")
    p.add_argument("--graph-capture", metavar="CAPTURE_TRACE",
                   help="trace of the CUDA/HIP graph capture that the (single) input replays: replayed kernels get the "
                        "FLOPs, op and module of their capture-time launch (default: the capture named by an "
                        "execution_details.json beside the trace, as vLLM/SGLang write it)")
    p.add_argument("--model-config", metavar="CONFIG_JSON",
                   help="the model's Hugging Face config.json: gives MoE expert ops (vllm::moe_forward) their FLOPs, "
                        "which the trace alone leaves unknown (the experts' intermediate size is not recorded)")
    p.add_argument("--resource-from-env", action="store_true",
                   help="add this machine's SLURM_*/torchrun/Kubernetes/host attributes to the resource "
                        "(use when ingesting on the node that ran the job; the trace's own rank and world size win)")


def _workers_for(args: argparse.Namespace, inputs: int | None = None) -> int:
    """--workers, or by default a process pool for several ranks (``inputs`` files; default: ``args.paths``):
    one process holding every rank grew to 1.9 GB at 1,000 ranks (a pool's parent: 0.5 GB) and took twice as
    long on 2 CPUs."""
    if getattr(args, "workers", None) is not None:
        return int(args.workers)
    from .sources.parallel import default_workers

    if inputs is None:
        inputs = len(getattr(args, "paths", None) or [])
    return default_workers(inputs) if inputs > 1 else 1


def stitch_options_from_args(args: argparse.Namespace, job_id: str, inputs: int | None = None) -> Any:
    """The stitch flags as IngestOptions, for ``inputs`` trace files (default: ``args.paths``)."""
    from .conventions import DEFAULT_BASELINE_MFU
    from .metrics.cpu_peak import cpu_price_from_env
    from .metrics.flops import load_model_config
    from .pipeline import IngestOptions
    from .sources.resource import parse_otel_resource_attributes, resource_from_env

    # OTEL_RESOURCE_ATTRIBUTES always applies, as in any OTel SDK; the rest of the environment only on request.
    extra: dict[str, Any] = parse_otel_resource_attributes(os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""))
    host = args.host
    if getattr(args, "resource_from_env", False):
        env_res = resource_from_env()
        host = host or env_res.get("host.name")
        for key in ("process.pid", "plasmient.job.id", "plasmient.rank", "plasmient.world_size", "service.name"):
            env_res.pop(key, None)  # the trace and the flags say these for the traced process
        extra = {**env_res, **extra}
    cpu_price, cpu_price_source = cpu_price_from_env()  # a CPU trace's price: the live rule, less the default
    if cpu_price is None and cpu_price_source:
        _warn(f"plasmient: {cpu_price_source}")
    return IngestOptions(
        job_id=job_id, max_spans=args.max_spans, extra_resource=extra, peak_tflops=args.peak_tflops, bandwidth_gbs=args.bandwidth_gbs,
        gpu_price=args.gpu_price, gpu_model=args.gpu_model, cpu_price=cpu_price,
        baseline_mfu=args.baseline_mfu or DEFAULT_BASELINE_MFU, ranks_per_node=args.ranks_per_node, host=host,
        graph_capture=getattr(args, "graph_capture", None), workers=_workers_for(args, inputs),
        chunk_rows=getattr(args, "chunk_rows", None),
        moe=load_model_config(args.model_config) if getattr(args, "model_config", None) else None,
    )


def _cmd_ingest(args: argparse.Namespace) -> int:
    from .metrics.flops import ModelConfigError
    from .pipeline import ingest_stream
    from .sources.kineto import TraceFormatError

    if args.ray is not None:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            say_error("plasmient", "--ray needs Ray: pip install 'plasmient-trace[ray]'")
            return EXIT_BAD_INPUT
        if args.ray and (Path(args.ray).is_file() or Path(args.ray).is_dir()):  # "" is the local Ray, not "."
            # `--ray rank-0.json rank-1.json` or `--ray traces/`: argparse took the first input for the address.
            args.paths, args.ray = [args.ray, *args.paths], ""
    if not args.paths:
        say_error("plasmient", "no trace given: name the trace files, a directory of them, or - (stdin)")
        return EXIT_BAD_INPUT
    from .export import sinks
    from .export.sinks import OutputError, check_distinct_outputs, check_not_an_input, is_stdout
    from .sources.rawinput import traces_in

    if args.out == "-":
        args.out = "/dev/stdout"  # the usual spelling of "write it to stdout"
    try:
        args.paths = stdin_for_dash(args.paths, "zcat trace.json.gz | plasmient ingest - --out spans.jsonl")
        job_id = args.job_id or _job_id_of_input(args.paths[0])
        args.paths = traces_in(args.paths)
    except ValueError as err:
        say_error("plasmient", str(err))
        return EXIT_BAD_INPUT
    try:  # a mistake in the OTLP settings is said before the traces are read, not after
        from .export import otlp, selection

        config = otlp.OtlpConfig.from_env(endpoint=args.endpoint, protocol=args.protocol)
    except ValueError as err:
        say_error("plasmient", otlp.redact(str(err)))
        return EXIT_BAD_INPUT
    choice = selection.select_exporters(os.environ, config.explicit)
    for note in choice.notes:
        _warn(f"plasmient: {note}")
    # The embedded default (a JSON lines file) when nothing else receives the traces.
    out = args.out if args.out is not None or choice.traces or choice.traces_off else "traces.jsonl"
    try:  # the outputs are checked before the traces are read (a long read, then "is a directory")
        if out:
            sinks.check_output_path(out)
        if args.parquet:
            sinks.check_output_dir(args.parquet)
    except OutputError as err:
        say_error("plasmient", f"cannot write {err}")
        return EXIT_BAD_INPUT
    try:
        if out:
            check_not_an_input(out, [*args.paths, getattr(args, "graph_capture", None),
                                     getattr(args, "model_config", None)])
        if out and args.parquet:
            from .export.parquet import parquet_files

            check_distinct_outputs({"--out": out, **{f"--parquet ({f.name})": f for f in parquet_files(args.parquet)}})
    except OutputError as err:
        say_error("plasmient", str(err))
        return EXIT_BAD_INPUT
    # the summary and the progress bar go where the spans do not
    console = None if args.quiet else _console(stderr=args.out is not None and is_stdout(args.out))
    try:
        options = stitch_options_from_args(args, job_id)
    except ModelConfigError as err:
        say_error("plasmient", str(err))
        return EXIT_BAD_INPUT
    options.ray = args.ray
    options.keep_records = bool(args.parquet)  # else each rank's tables stay in the worker that read them
    bar = None
    try:
        if console is not None and console.is_terminal:  # into a log, a transient bar leaves only a blank line
            from rich.progress import Progress

            bar = Progress(transient=True, console=console)
            bar.start()
            task = bar.add_task("ingest", total=len(args.paths) + 1)

            def progress(what: str, done: int, total: int) -> None:
                bar.update(task, completed=done, total=total, description=what)

            stream = ingest_stream(args.paths, options, progress=progress)
        else:
            stream = ingest_stream(args.paths, options)
        unknown = stream.stats.get("unknown_devices", [])
        if unknown:  # one line, whatever the number of ranks: a thousand ranks used to print a thousand
            where = unknown[0] if len(unknown) == 1 else f"{len(unknown)} of {len(args.paths)} inputs ({_first_few(unknown)})"
            _warn(f"plasmient: unknown device in {where}: no MFU on {'its' if len(unknown) == 1 else 'their'} "
                  f"spans ({_naming_hint(args.gpu_model, stream.stats.get('unknown_device_types') == ['cpu'])})")
        # each rank may say the same (a thousand MI250 ranks: one line)
        for note in dict.fromkeys(stream.stats.get("notes", []) + stream.stats.get("clock_notes", [])):
            _say(args, f"plasmient: {note}")
        for warning in stream.stats.get("warnings", []):
            _warn(f"plasmient: {warning}")
        status, summary = _deliver(args, stream, _Destinations(config, choice, out), bar)
    except TraceFormatError as err:
        say_error("plasmient", str(err))
        return EXIT_BAD_INPUT
    except (ValueError, IndexError, TypeError, ArithmeticError, MemoryError) as err:
        # Input that parsed but that the stitcher could not use: still one line naming the input.
        # PLASMIENT_DEBUG=1 re-raises, for whoever fixes the stitcher.
        if os.environ.get("PLASMIENT_DEBUG"):
            raise
        names = ", ".join(str(p) for p in args.paths)
        what = str(err).splitlines()[0][:200] if str(err) else ""
        say_error("plasmient", f"{names}: cannot stitch ({type(err).__name__}{': ' + what if what else ''})")
        return EXIT_BAD_INPUT
    finally:
        if bar is not None:
            bar.stop()
    if status == EXIT_BAD_INPUT:
        return status
    if console is not None:
        from .report.summary import render_summary

        render_summary(summary, console=console)
    return status


def _job_id_of_input(first_input: str) -> str:
    """The job id when --job-id and the environment name none: a directory of rank traces is named after the
    job (``.`` as the directory it is), a file by its name up to the first dot."""
    path = Path(first_input)
    name = path.resolve().name if path.is_dir() else path.name.split(".")[0]
    return name or "job"


def _first_few(names: list[str], shown: int = 3) -> str:
    """'a, b, c and 997 more'."""
    head = ", ".join(str(n) for n in names[:shown])
    return head if len(names) <= shown else f"{head} and {len(names) - shown} more"


@dataclass(frozen=True)
class _Destinations:
    """Where ingest delivers, settled (and its paths checked) before the traces are read."""

    config: Any  # the OTLP settings (export.otlp.OtlpConfig)
    choice: Any  # which exporters OTEL_*_EXPORTER asks for (export.selection)
    out: str | None  # the span file; None when a remote backend alone receives the traces


def _deliver(args: argparse.Namespace, stream: Any, where: _Destinations, bar: Any = None) -> tuple[int, Any]:
    """The export tail of ingest: the one delivery path live capture uses too (export.delivery).

    The stream's parts (whole traces, a group of steps each) are written as they are stitched and let go;
    only their fleet/node/rank/step spans are kept, for the summary. --rebase-time (which moves every span by
    the offset of the last one) and --parquet (which keeps every record) take the spans in one part."""
    from .conventions import upper_spans
    from .export import delivery, rebase, sinks, spill
    from .stitch.fleet import merge_span_batches

    config, out = where.config, where.out
    parts = iter([stream.collect().batch]) if args.rebase_time or args.parquet else stream.parts
    remote, console = sinks.chosen_sinks(where.choice, config)
    send = bool(remote)
    local: list[Any] = [sinks.FileSink(out, append=False)] if out is not None else []
    local += console
    if args.parquet:
        local.append(sinks.ParquetSink(args.parquet, stream.records))
    spill_dir = spill.SpillDir(spill.default_spill_dir(out)) if send else None
    said: list[str] = []
    # Ingest waits for room in the export queue (memory stays bounded by a few parts) instead of spilling.
    sink = delivery.Delivery(local, remote, spill_dir, say=lambda key, line: said.append(line), wait_when_full=True,
                             max_queue_bytes=128 << 20)
    kept, spans = [], 0
    try:
        for batch in parts:
            if args.rebase_time:
                batch, offset = rebase.rebase_time(batch)
                _say(args, f"plasmient: --rebase-time: every span moved by {offset / 1e9 / 86400:+.2f} days so the last one ends now")
            sink.submit(batch)
            spans += len(batch)
            kept.append(upper_spans(batch))
        sink.close_local()
    except BaseException as err:
        # no partial output; the caller reports what is not ours to report (bad input mid-stream, Ctrl-C)
        sink.close_local(commit=False)
        sink.shutdown(0)
        if isinstance(err, sinks.OutputClosed):
            raise BrokenPipeError(str(err)) from None  # main() ends quietly
        if not isinstance(err, sinks.OutputError):
            raise
        say_error("plasmient", f"cannot write {err}")
        return EXIT_BAD_INPUT, None
    if bar is not None:
        bar.stop()
    summary = merge_span_batches(kept)
    if out is not None:
        _say(args, f"plasmient: wrote {local[0].lines} trace(s), {spans} spans to {out}")
    if args.parquet:
        _say(args, f"plasmient: wrote {len(local[-1].files)} Parquet files to {args.parquet}")
    if not send:
        return 0, summary
    stats = sink.shutdown(None)  # every request has its own deadline: this wait is bounded
    return _report_delivery(args, stats, config, spill_dir.path, spans), summary


def _report_delivery(args: argparse.Namespace, stats: Any, config: Any, spill_path: Any, spans: int) -> int:
    """One line per signal: sent, not taken by this backend (not an error), or failed (exit 1)."""
    from .export import otlp

    status = 0
    for signal, why in stats.unsupported.items():
        if signal == "traces":
            say_error("plasmient", f"{why}; no span was delivered")
            status = EXIT_EXPORT_FAILED
        else:
            # Printed even with --quiet: the user should switch the signal off, not see this every run.
            print(f"plasmient: the backend takes no {signal} ({why}); every span was delivered. "
                  f"Set OTEL_METRICS_EXPORTER=none to stop sending them", file=sys.stderr)
    if stats.errors:
        # One line for the outage: the first error names its signal; the tail says what waits where.
        failed = sorted(stats.errors, key=lambda sig: sig != "traces")
        # every signal that waits or is gone: one that found the collector down through another's error has none
        held = sorted({*failed, *stats.spilled, *stats.dropped}, key=lambda sig: sig != "traces")
        kept = [f"{sig} of {stats.spilled[sig]} span(s)" for sig in held if stats.spilled.get(sig)]
        lost = [f"{sig} of {stats.dropped[sig]} span(s)" for sig in held if stats.dropped.get(sig)]
        # never "spilled, resend" for spans that are gone: a spill directory that cannot be written keeps none
        tail = [f"{' and '.join(kept)} spilled to {spill_path}; resend with `plasmient replay {spill_path}`"] if kept else []
        tail += [f"{' and '.join(lost)} could not be spilled to {spill_path} and are lost"] if lost else []
        say_error("plasmient", f"{stats.errors[failed[0]]}; {'; '.join(tail) or 'nothing was spilled'}")
        status = EXIT_EXPORT_FAILED
    endpoint = otlp.redact_url(config.endpoint)
    if "traces" in stats.sent and "traces" not in stats.errors:
        _say(args, f"plasmient: sent {spans} spans to {endpoint} ({config.protocol}), {stats.requests.get('traces', 0)} request(s)")
    if "metrics" in stats.sent and "metrics" not in stats.errors:
        _say(args, "plasmient: sent step metrics (MFU, util, stall, wasted $) with trace-id exemplars")
    return status


def _say(args: argparse.Namespace, line: str) -> None:
    """An informational line: what was written or sent (--quiet silences it)."""
    if not getattr(args, "quiet", False):
        print(line, file=sys.stderr)


def _warn(line: str) -> None:
    """A line about what the result lacks or what was ignored (an unknown device, an exporter no one can
    use): printed with --quiet too, which means no progress bar and no summary, not fewer warnings."""
    print(one_printable_line(line), file=sys.stderr)  # an input's name may hold a newline or an escape


def _naming_hint(gpu_model: str | None, cpu: bool = False) -> str:
    """What to do about a device the hardware table does not know, given the --gpu-model the user passed;
    a CPU trace names no peak at all (a live run calibrates one), so only --peak-tflops helps."""
    if cpu and not gpu_model:
        return "a CPU's peak is not in its trace: set --peak-tflops"
    if not gpu_model:
        return "name it with --gpu-model or set --peak-tflops"
    from .metrics.hardware import SPECS

    return f"--gpu-model {gpu_model!r} is none of {', '.join(SPECS)}; name one of them or set --peak-tflops"


def _console(stderr: bool = False) -> Any:
    """A rich console whose closed pipe ends the command as any other write to it does (main() says
    nothing and exits EXIT_PIPE_CLOSED); rich's own handling exits 1."""
    from rich.console import Console

    class _PipeAwareConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError("stdout closed")

    return _PipeAwareConsole(stderr=stderr)



def _cmd_link(args: argparse.Namespace) -> int:
    from .export.links import jaeger_link, tempo_link
    from .stitch import ids

    trace = ids.trace_id(args.job_id, args.step).hex()
    try:  # every link asked for, each on its line (built first: a bad URL prints none of them)
        lines = [jaeger_link(args.jaeger, trace)] if args.jaeger else []
        lines += [tempo_link(args.tempo, trace, datasource=args.tempo_datasource)] if args.tempo else []
        print("\n".join(lines or [trace]))
    except ValueError as err:  # a URL that is not http(s): said in one line, like any bad argument
        say_error("plasmient link", str(err))
        return 2
    return 0


def build_parser(only_run: bool = False) -> argparse.ArgumentParser:
    """The command line. ``only_run``: just `plasmient run`, whose process only starts the job and waits for it,
    so it does not import what the other commands' arguments need (numpy, pyarrow, the stitch and the report:
    half a second before every traced job)."""
    parser = OneLineErrorParser(prog="plasmient", description="Vertical OpenTelemetry traces for GPU jobs, with MFU and cost on every span.")
    parser.add_argument("--version", action="version", version=f"plasmient-trace {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    if only_run:
        from .capture import cli as capture_cli

        capture_cli.register(sub)
        return parser

    ingest = sub.add_parser("ingest", help="stitch Kineto trace files (one per rank) into one OTel trace per step")
    # "*", not "+": `--ray logdir/` leaves no positional, and the input argparse gave --ray is put back below
    ingest.add_argument("paths", nargs="*", help="Kineto Chrome-trace files (.json or .json.gz), one per rank, or a directory of them; - reads stdin")
    ingest.add_argument("--out", type=_output_path, help="write OTLP/JSON lines here ('-': stdout; default traces.jsonl when no endpoint is configured)")
    ingest.add_argument("--endpoint", help="OTLP endpoint (default $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / $OTEL_EXPORTER_OTLP_ENDPOINT)")
    ingest.add_argument("--protocol", choices=("grpc", "http/protobuf", "http/json"), help="OTLP protocol (default $OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)")
    ingest.add_argument("--parquet", type=_output_path, metavar="DIR", help="also write every record table and the spans as Parquet")
    ingest.add_argument("--rebase-time", action="store_true",
                        help="shift every span by one offset so the last one ends now, keeping all relative times, "
                             "for UIs that only search recent traces (off by default: spans keep their recording time; "
                             "find an old trace by id with `plasmient link`)")
    ingest.add_argument("--quiet", action="store_true",
                        help="no progress bar, no summary, no lines on what was written or sent (warnings stay)")
    ingest.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="run the ranks as tasks on Ray: the cluster at ADDRESS (e.g. auto, ray://head:10001), "
                             "or without one a local Ray with --workers CPUs (default: all). Needs "
                             "pip install 'plasmient-trace[ray]'")
    add_stitch_arguments(ingest)
    ingest.set_defaults(func=_cmd_ingest)

    link = sub.add_parser("link", help="print the trace id (or a Jaeger/Tempo link) of a job's step")
    link.add_argument("--job-id", required=True, help="the job id the spans carry (plasmient.job.id): --job-id of ingest, "
                                                       "else the trace file's name up to its first dot")
    link.add_argument("--step", type=_step_number, required=True, help="the step number (N of ProfilerStep#N)")
    link.add_argument("--jaeger", metavar="URL", help="Jaeger UI base URL, e.g. http://localhost:16686")
    link.add_argument("--tempo", metavar="URL", help="Grafana base URL with a Tempo data source, e.g. http://localhost:3000")
    link.add_argument("--tempo-datasource", default="tempo", help="Grafana data source uid of Tempo (default 'tempo')")
    link.set_defaults(func=_cmd_link)

    try:
        from .report.cli import add_report_arguments, run_report

        report = sub.add_parser("report", help="render an OTLP JSON lines file as a terminal summary or an HTML report")
        add_report_arguments(report)
        report.set_defaults(func=run_report)
    except ImportError:
        pass
    for module, name in (("capture.cli", "run"), ("export.spill", "replay"), ("report.diff_cli", "diff")):
        try:
            mod = __import__(f"plasmient_trace.{module}", fromlist=["register"])
            mod.register(sub)
        except ImportError:
            pass
    return parser


# Commands that build and drop many Arrow buffers; `run` is left alone (its child is the user's job).
ARROW_HEAVY_COMMANDS = ("ingest", "report", "replay", "diff")


# Commands that clean up behind them (a process pool, temporary files, an output renamed into place). SIGTERM's
# default action skips that: a `kill` of a pooled ingest left its workers running and its spill directory
# behind. replay defers SIGTERM itself, and run forwards it to the job.
TERMINATED_CLEANLY = ("ingest", "report", "diff")
EXIT_TERMINATED = 128 + 15


class _Terminated(BaseException):
    """SIGTERM, raised where the main thread is, so the ``finally`` blocks on the way out run."""


def _raise_terminated(_signum: int, _frame: Any) -> None:
    raise _Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    import signal
    import threading

    args_given = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(only_run=bool(args_given) and args_given[0] == "run")
    args = parser.parse_args(argv)
    if args.command in ARROW_HEAVY_COMMANDS:
        from .arrow_memory import use_offline_pool

        use_offline_pool()
    previous = None
    if args.command in TERMINATED_CLEANLY and threading.current_thread() is threading.main_thread() \
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("plasmient: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("plasmient: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except SystemError as exc:
        # The signal's exception, raised while C code ran that does not expect one (Ray's object fetch), comes
        # out wrapped: "... returned a result with an exception set", a traceback and exit 1 about 1 run in 6.
        if isinstance(exc.__cause__, _Terminated):
            print("plasmient: terminated", file=sys.stderr)
            return EXIT_TERMINATED
        if isinstance(exc.__cause__, KeyboardInterrupt):
            print("plasmient: interrupted", file=sys.stderr)
            return 130
        raise
    except BrokenPipeError:
        # what is still buffered would fail again at exit, with a message: send it nowhere
        for stream in (sys.stdout, sys.stderr):
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
            except (OSError, ValueError, AttributeError):
                pass
        return EXIT_PIPE_CLOSED
    except OSError as exc:
        # a refusal of the file system no command foresaw (a name longer than it allows): one line, not a traceback
        where = f"{exc.filename}: " if exc.filename is not None else ""
        prefix = f"plasmient {args.command}" if args.command in ("report", "diff", "link") else "plasmient"
        say_error(prefix, f"{where}{exc.strerror or exc}")
        return 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
