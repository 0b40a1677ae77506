"""plasmient-trace: one OpenTelemetry trace per training step, kernel to fleet, with MFU and cost on every span.

Layout (each module has one job):
  sources/   capture: Kineto files, live CUPTI + torch hooks  -> records.RecordSet (Arrow tables)
  stitch/    joins (kernel->launch->op->module->step), clock mapping, the span tree, deterministic ids
  metrics/   FLOP/byte models, hardware peaks, per-span metrics, culprits
  export/    OTLP (gRPC/HTTP), OTLP JSON lines file, Parquet, OTel metrics
  report/    terminal summary and the HTML report
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    # `with plasmient_trace.step():` without importing torch at package import time.
    if name == "step":
        from .capture import step

        return step
    raise AttributeError(f"module 'plasmient_trace' has no attribute {name!r}")
