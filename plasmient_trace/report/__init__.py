"""Human-facing outputs of a SpanBatch: the terminal summary and the self-contained HTML report.

``summary`` prints per-step util vs MFU, the gap and the culprits; ``html`` writes one HTML file
(icicle, timeline, roofline, bill) with no network fetches; ``cli`` is `plasmient report`.
"""

from plasmient_trace.report.html import build_report, write_report
from plasmient_trace.report.summary import render_summary, summary_rows

__all__ = ["build_report", "write_report", "render_summary", "summary_rows"]
