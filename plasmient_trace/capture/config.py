"""Live capture's configuration and where its spans go: CaptureConfig (the PLASMIENT_* and OTEL_*
variables), the once-only stderr lines of the capture, and the Delivery a live run exports through
(the same :class:`..export.delivery.Delivery` as ``plasmient ingest``)."""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..conventions import MAX_FLAG_VALUE, SpanBatch
from ..sources.resource import job_id_from_env

Exporter = Callable[[SpanBatch], None]

_PREFIX = "plasmient-trace:"
_said: set[str] = set()
_said_lock = threading.Lock()


def say_once(key: str, message: str) -> None:
    """One line on stderr per distinct ``key`` for the life of the process."""
    with _said_lock:
        if key in _said:
            return
        _said.add(key)
    try:
        print(f"{_PREFIX} {message}", file=sys.stderr, flush=True)
    except Exception:
        pass


def notice(key: str, message: str) -> None:
    """Like :func:`say_once`, for news that is not a failure (where traces go, a background build):
    printed only with PLASMIENT_VERBOSE=1, so the job's stderr stays exactly its own."""
    if os.environ.get("PLASMIENT_VERBOSE", "").strip().lower() in ("1", "true", "yes", "on"):
        say_once(key, message)


def _env_float(env: Mapping[str, str], name: str, upper: float = MAX_FLAG_VALUE) -> float | None:
    """A positive number in (0, upper] from the environment; 0 is as if unset, and anything else (negative,
    NaN, inf, a typo) is said once and ignored."""
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        out = float(value)
    except ValueError:
        say_once(f"bad-{name}", f"ignoring {name}={value!r}: not a number")
        return None
    if 0 < out <= upper:
        return out
    if out != 0:  # negative, too large, inf or NaN: a mistake worth saying (0 is "off", as if unset)
        say_once(f"bad-{name}", f"ignoring {name}={value!r}: not a number in (0, {upper:g}]")
    return None


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name, "").strip()
    if not value:
        return default
    try:
        out = int(value)
        if out > 0:
            return out
    except ValueError:
        pass
    say_once(f"bad-{name}", f"ignoring {name}={value!r}: not a positive integer")
    return default


def _env_choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (the first is the default); anything else is said once and ignored."""
    value = env.get(name, "").strip().lower()
    if not value:
        return choices[0]
    if value in choices:
        return value
    say_once(f"bad-{name}", f"ignoring {name}={value!r}: not one of {', '.join(choices)}")
    return choices[0]


def _overhead(env: Mapping[str, str]) -> float | None:
    """PLASMIENT_OVERHEAD; unset: the default budget, unless PLASMIENT_EVERY asks for a rate itself."""
    from .budget import DEFAULT_FRACTION

    default = None if env.get("PLASMIENT_EVERY", "").strip() else DEFAULT_FRACTION
    raw = env.get("PLASMIENT_OVERHEAD", "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value == 0:
        return None  # asked for: no limit
    if 0 < value < 1:
        return value
    say_once("bad-PLASMIENT_OVERHEAD", f"ignoring PLASMIENT_OVERHEAD={raw!r}: not a share of wall time in [0, 1)")
    return default


@dataclass
class CaptureConfig:
    """What the capture does; ``from_env`` reads the documented PLASMIENT_* and OTEL_* variables.

    PLASMIENT_OUT           OTLP/JSON lines file (default traces.jsonl, traces.rank<R>.jsonl with ranks);
                            {rank} in it is the process's rank (one file per rank, e.g. on NFS)
    PLASMIENT_EVERY         full depth every N-th step (default 10; 1 = every step)
    PLASMIENT_OVERHEAD      and no more often than keeps their background work under this share of
                            wall time (default 0.02 when PLASMIENT_EVERY is not set, else no limit;
                            0 = no limit); see capture.budget
    PLASMIENT_MFU_THRESHOLD capture the next step at full depth when a step's estimated MFU is below
    PLASMIENT_MAX_SIGNATURES  input-shape signatures captured at full depth when first seen (default 64);
                            a step with a signature past that (and not picked by PLASMIENT_EVERY) has
                            no FLOPs (plasmient.flops.source = unknown)
    PLASMIENT_MAX_STEP_OPS  ops (and, apart, module calls) a full-depth step records (default 200000):
                            a step past it goes out at step depth, its FLOPs carried or unknown, which
                            bounds the memory and background time of a step of millions of tiny ops
    PLASMIENT_JOB_ID        job id the trace ids derive from (else SLURM_JOB_ID.SLURM_STEP_ID, then
                            TORCHELASTIC_RUN_ID; else rank 0's generated id, shared through the store)
    PLASMIENT_PEAK_TFLOPS   override the device peak (TFLOP/s); skips the CPU calibration
    PLASMIENT_GPU_PRICE     USD per device-hour
    PLASMIENT_CPU_PRICE     USD per hour of a CPU-only job's cores (default $0.05 per vCPU-hour x its threads;
                      `plasmient ingest` of a CPU trace uses it too, with no default: unset, no cost)
    PLASMIENT_CUPTI=0 / PLASMIENT_NVML=0   disable those sources
    PLASMIENT_CUPTI=kineto  kernels through torch.profiler (Kineto) instead of cupti-python, which is
                            also the fallback when cupti-python is missing or CUPTI is taken
    PLASMIENT_CUPTI_API     full (default): CUPTI records host API calls (launches, the kernel -> op
                            join, the launch queue and idle split) on full-depth steps only; always:
                            on every step too, at a launch-bound step's cost
    PLASMIENT_OP_HOOK       how full-depth steps see ops: auto (default: the native RecordFunction
                            observer, built once in the background, the dispatch hook until it is
                            ready), native (build it now, before the first step), dispatch (the
                            Python TorchDispatchMode only)
    PLASMIENT_WORKER        where finished steps are stitched and delivered: process (default: an interpreter
                            of its own, fed each batch over a socket, so the stitch does not hold the
                            training thread's GIL; a multi-rank job keeps the thread, as its fleet spans
                            need its process group) or thread (a thread of the job's process)
    PLASMIENT_EXPORT_INTERVAL_S  how long finished steps are batched before one stitch+export (2 s; a
                            batch also closes at 256 steps or 32 full-depth ones)
    PLASMIENT_FLUSH_TIMEOUT_S    the most the job waits at exit (or SIGTERM) for queued steps (5 s)
    PLASMIENT_SPILL_DIR     where spans wait while the collector is down (default plasmient-spill/
                            beside PLASMIENT_OUT, else in the working directory); PLASMIENT_SPILL_MAX_MB
                            bounds it (1024)
    PLASMIENT_VERBOSE=1     also say where traces go and what runs in the background (failures are
                            always said, once)
    OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_EXPORTER (otlp | console | none),
    OTEL_METRICS_EXPORTER=none (no step metrics over OTLP),
    OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT / PROTOCOL / HEADERS / TIMEOUT: as in every OTel SDK.
    """

    out: str | None = None
    every: int = 10
    overhead: float | None = None  # capture.budget: None = full depth exactly every N-th step
    mfu_threshold: float | None = None
    max_signatures: int = 64
    max_step_ops: int = 200_000
    job_id: str | None = None
    peak_tflops: float | None = None
    gpu_price: float | None = None
    service_name: str | None = None
    traces_exporter: str = ""
    cupti: bool = True
    kineto: bool = False   # force the Kineto fallback (PLASMIENT_CUPTI=kineto)
    cupti_api_always: bool = False  # PLASMIENT_CUPTI_API=always: launches recorded on step-depth steps too
    nvml: bool = True
    op_hook: str = "auto"  # auto | native | dispatch (PLASMIENT_OP_HOOK)
    worker: str = "process"  # process | thread (PLASMIENT_WORKER)
    # Steps waiting for the worker: full-depth ones hold every op of the step (the memory this bounds); a
    # step-depth one is a few hundred bytes, so many more may wait. With one bound of 64 for both, a loop of
    # 0.4 ms steps lost 474 of 1,000 while the worker stitched a batch.
    queue_steps: int = 64
    queue_step_depth_steps: int = 16384
    flush_timeout_s: float = 5.0
    export_interval_s: float = 2.0
    max_batch_steps: int = 256       # steps stitched and exported together, at most (export_interval_s first)
    # of which at full depth (None: batch_full_steps()'s default)
    max_batch_full_steps: int | None = None
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def batch_full_steps(self) -> int:
        """Full-depth steps one batch holds at most. On the job's thread 32: a batch of 64 tiny-transformer
        steps (92k spans) cost the training loop more than two of 32 (its tables and text, first touched and
        streamed through the cache the training shares), and 16 or fewer pay the batch's fixed cost too often.
        In the batch process 8: it stitches beside the loop, not under its GIL, so a batch sent sooner only
        leaves less to wait for at exit (full depth every step, 100-step rounds with the drain: 1.109 and
        1.134 at 8, 1.164 at 16, 1.277 at 32, in one hour's runs)."""
        if self.max_batch_full_steps is not None:
            return self.max_batch_full_steps
        return 8 if self.worker == "process" else 32

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> "CaptureConfig":
        env = dict(os.environ if environ is None else environ)
        job = job_id_from_env(env)
        # read where the CPU is calibrated (metrics.cpu_peak, which falls back to its default price); checked
        # here so that a price that is not one is said once, as every other variable's mistake is
        _env_float(env, "PLASMIENT_CPU_PRICE")
        cfg = cls(
            # "~/t.jsonl" from an env file or a pod spec, where no shell expands it: a folder named "~" else
            out=os.path.expanduser(env["PLASMIENT_OUT"]) if env.get("PLASMIENT_OUT") else None,
            every=_env_int(env, "PLASMIENT_EVERY", 10),
            overhead=_overhead(env),
            mfu_threshold=_env_float(env, "PLASMIENT_MFU_THRESHOLD", upper=1.0),
            max_signatures=_env_int(env, "PLASMIENT_MAX_SIGNATURES", 64),
            max_step_ops=_env_int(env, "PLASMIENT_MAX_STEP_OPS", 200_000),
            job_id=job,
            peak_tflops=_env_float(env, "PLASMIENT_PEAK_TFLOPS"),
            gpu_price=_env_float(env, "PLASMIENT_GPU_PRICE"),
            service_name=env.get("OTEL_SERVICE_NAME") or None,
            traces_exporter=env.get("OTEL_TRACES_EXPORTER", "").strip().lower(),
            cupti=env.get("PLASMIENT_CUPTI", "1") not in ("0", "false", "no"),
            kineto=env.get("PLASMIENT_CUPTI", "").strip().lower() == "kineto",
            cupti_api_always=_env_choice(env, "PLASMIENT_CUPTI_API", ("full", "always")) == "always",
            nvml=env.get("PLASMIENT_NVML", "1") not in ("0", "false", "no"),
            op_hook=(env.get("PLASMIENT_OP_HOOK") or "auto").strip().lower(),
            worker=_env_choice(env, "PLASMIENT_WORKER", ("process", "thread")),
            flush_timeout_s=_env_float(env, "PLASMIENT_FLUSH_TIMEOUT_S") or 5.0,
            export_interval_s=_env_float(env, "PLASMIENT_EXPORT_INTERVAL_S") or 2.0,
            environ=env,
        )
        for k, v in overrides.items():
            if v is not None:
                setattr(cfg, k, v)
        return cfg


# ---------------------------------------------------------------------------------------------
# Delivery


def default_out_path(resource: Mapping[str, Any]) -> str:
    world = resource.get("plasmient.world_size")
    rank = resource.get("plasmient.rank")
    if isinstance(world, int) and world > 1 and isinstance(rank, int):
        return f"traces.rank{rank}.jsonl"
    return "traces.jsonl"


def out_path_of(out: str | None, resource: Mapping[str, Any]) -> str | None:
    """PLASMIENT_OUT with ``{rank}`` replaced by the process's rank (0 when it has none). Ranks of one host
    share a file safely (one ``write()`` per line with O_APPEND), but NFS does not keep appends from several
    machines apart: ``/nfs/run/traces.rank{rank}.jsonl`` gives each rank its own file."""
    if out is None or "{rank}" not in out:
        return out
    rank = resource.get("plasmient.rank")
    return out.replace("{rank}", str(rank if isinstance(rank, int) else 0))


def build_delivery(config: CaptureConfig, resource: Mapping[str, Any], extra: list[tuple[str, Exporter]] | None = None) -> Any:
    """The live run's :class:`..export.delivery.Delivery`, chosen as every OTel SDK does:
    OTEL_TRACES_EXPORTER, else OTLP when an endpoint is configured, else the embedded default (an
    OTLP/JSON lines file). PLASMIENT_OUT always adds the file; OTLP brings the step metrics too
    (unless OTEL_METRICS_EXPORTER=none). ``extra`` (name, fn) pairs are further local sinks; given
    alone they replace the configured ones."""
    from ..export import delivery, sinks, spill

    local: list[Any] = [sinks.CallableSink(name, fn) for name, fn in extra or []]
    out = out_path_of(config.out, resource)  # the file, and the spill directory beside it
    remote: list[Any] = []
    traces_off = False
    if extra is None:
        from ..export import otlp
        from ..export.selection import select_exporters

        try:
            otlp_cfg = otlp.OtlpConfig.from_env(config.environ)
        except Exception as err:
            say_once("otlp-config", f"OTLP export disabled: {otlp.redact(str(err))}")
            otlp_cfg = None
        # the same selection ingest makes: OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER, else OTLP when an
        # endpoint is configured
        choice = select_exporters(config.environ, otlp_cfg is not None and otlp_cfg.explicit)
        for note in choice.notes:
            say_once(f"exporter:{note}", note)
        traces_off = choice.traces_off
        remote, console = sinks.chosen_sinks(choice, otlp_cfg)
        local += console
        path = out
        if path is None and not remote and not local and not traces_off:
            path = default_out_path(resource)
        if path is not None:
            # The local file goes first and never waits for the network.
            local.insert(0, sinks.FileSink(os.path.abspath(path), append=True))
    spill_dir = spill.SpillDir(spill.default_spill_dir(out, config.environ),
                               max_bytes=int((_env_float(config.environ, "PLASMIENT_SPILL_MAX_MB") or 1024) * (1 << 20)))
    return delivery.Delivery(local, remote, spill_dir if remote else None, say=say_once, strict_local=False)


def say_where(delivery: Any, job_id: str) -> None:
    """Where the traces of ``job_id`` go, said once per sink (with PLASMIENT_VERBOSE=1)."""
    for sink in delivery.local + delivery.remote:
        what = "traces" if not hasattr(sink, "signal") else sink.signal
        notice(f"where-{sink.name}-{what}", f"tracing job {job_id!r}: writing {what} to {sink.name}")
    if not (delivery.local or delivery.remote):
        notice("no-exporter", "OTEL_TRACES_EXPORTER=none: traces are captured but not exported")


def report_delivery(stats: Any) -> None:
    """At the end of a live run, what could be neither delivered nor spilled (an outage was said when it began,
    with the spill directory)."""
    if sum(stats.dropped.values()):
        # per signal: a metrics line carries the same spans as its trace line, so a sum counted them twice
        # (5,755 "spans" lost of the 3,491 a job made)
        lost = [f"{n} span(s) of traces" if signal == "traces" else f"the step metrics of {n} span(s)"
                for signal, n in sorted(stats.dropped.items(), key=lambda kv: kv[0] != "traces") if n]
        say_once("delivery-dropped", f"{' and '.join(lost)} could not be delivered nor spilled")
