"""Links that open one step's trace in a UI: Jaeger's trace page, or Grafana Explore on a Tempo data source.

Formats:
- Jaeger UI: ``{base}/trace/{trace_id}`` (32 lowercase hex digits).
- Grafana Explore (Grafana 10 and later): ``{base}/explore?schemaVersion=1&panes=<JSON>&orgId=N``,
  where the JSON maps a pane id to ``{"datasource": uid, "queries": [...], "range": {...}}`` — the
  serialised Explore state Grafana itself writes into the URL (``serializeStateToUrlParam`` in
  ``@grafana/data``). The query is a Tempo ``traceql`` query whose text is the trace id, which
  Tempo's query editor treats as a trace lookup. Older Grafana (< 10) used ``/explore?left=...``;
  it is not generated here.

The trace id is checked (hex, 16 bytes) so a typo fails here, not as an empty page in a browser.
"""

from __future__ import annotations

import json
from urllib.parse import quote, urlencode

__all__ = ["jaeger_link", "tempo_link", "explore_panes"]

_PANE_ID = "plasmient"


def _trace_hex(trace_id_hex: str) -> str:
    text = trace_id_hex.strip().lower()
    if len(text) != 32:
        raise ValueError(f"trace id must be 32 hex digits, got {trace_id_hex!r}")
    try:
        bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"trace id must be 32 hex digits, got {trace_id_hex!r}") from None
    return text


def _base(url: str) -> str:
    base = url.strip().rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"expected an http(s) URL, got {url!r}")
    return base


def jaeger_link(url: str, trace_id_hex: str) -> str:
    """Jaeger UI page of one trace, e.g. ``http://localhost:16686/trace/<id>``."""
    return f"{_base(url)}/trace/{_trace_hex(trace_id_hex)}"


def explore_panes(trace_id_hex: str, datasource: str = "tempo", time_range: tuple[str, str] = ("now-24h", "now")) -> dict:
    """The Explore ``panes`` state: one pane with a Tempo trace-id query."""
    trace = _trace_hex(trace_id_hex)
    return {
        _PANE_ID: {
            "datasource": datasource,
            "queries": [
                {
                    "refId": "A",
                    "datasource": {"type": "tempo", "uid": datasource},
                    "queryType": "traceql",
                    "query": trace,
                }
            ],
            "range": {"from": time_range[0], "to": time_range[1]},
        }
    }


def tempo_link(
    grafana_url: str,
    trace_id_hex: str,
    datasource: str = "tempo",
    org_id: int = 1,
    time_range: tuple[str, str] = ("now-24h", "now"),
) -> str:
    """Grafana Explore URL showing the trace from the Tempo data source with uid ``datasource``.

    ``time_range`` is (from, to) in Grafana's syntax (``now-24h`` or epoch milliseconds as text);
    Tempo looks a trace id up regardless, the range only sets the page's time picker.
    """
    panes = json.dumps(explore_panes(trace_id_hex, datasource, time_range), separators=(",", ":"))
    query = urlencode({"schemaVersion": 1, "panes": panes, "orgId": int(org_id)}, quote_via=quote, safe="")
    return f"{_base(grafana_url)}/explore?{query}"
