"""Writes schemas/ from the code: the Arrow schema of every record table and the span attribute conventions.

`python -m plasmient_trace.schemas` regenerates the files; `python -m plasmient_trace.schemas --check`
exits 1 when the checked-in files differ from the code (CI runs the same comparison as a test).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from .conventions import CORE_COLUMNS, RESOURCE_ATTRIBUTES, SPAN_ATTRIBUTES, SpanAttribute, value_range
from .records import TABLE_SCHEMAS

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "schemas"


def _field(f: pa.Field) -> dict[str, Any]:
    meta = {k.decode(): v.decode() for k, v in (f.metadata or {}).items()}
    out: dict[str, Any] = {"name": f.name, "type": str(f.type), "nullable": f.nullable}
    out.update(meta)
    return out


def records_document() -> dict[str, Any]:
    return {
        "description": "Arrow schemas of the record tables every source produces (plasmient_trace/records.py). "
                       "Timestamps are int64 ns on the process's CPU clock.",
        "tables": {name: [_field(f) for f in schema] for name, schema in TABLE_SCHEMAS.items()},
    }


def _range_fields(attribute: SpanAttribute) -> dict[str, float]:
    """JSON Schema's minimum/maximum for a numeric attribute (value_range); none for an unbounded side."""
    bounds = value_range(attribute)
    if bounds is None:
        return {}
    low, high = bounds
    if pa.types.is_integer(attribute.type):
        return {"minimum": int(low)}  # integer amounts are counts: no share is an int
    return {"minimum": low} if high == float("inf") else {"minimum": low, "maximum": high}


def spans_document() -> dict[str, Any]:
    return {
        "description": "Span attribute conventions of plasmient-trace (plasmient_trace/conventions.py). "
                       "Every span carries the metric attributes; level-specific ones are listed with their levels.",
        "span_table_core_columns": [_field(f) for f in CORE_COLUMNS],
        "attributes": [
            {"name": a.name, "type": str(a.type), "unit": a.unit, "levels": list(a.levels), "description": a.description,
             **_range_fields(a)}
            for a in SPAN_ATTRIBUTES
        ],
        "resource_attributes": [{"name": k, "source": v} for k, v in RESOURCE_ATTRIBUTES.items()],
    }


def documents() -> dict[str, str]:
    dump = lambda doc: json.dumps(doc, indent=2, sort_keys=False) + "\n"  # noqa: E731
    from .report.diff import diff_document

    return {"records.json": dump(records_document()), "span_attributes.json": dump(spans_document()),
            "diff.json": dump(diff_document())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--dir", type=Path, default=SCHEMA_DIR)
    args = parser.parse_args(argv)
    stale = []
    for name, text in documents().items():
        path = args.dir / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("schemas out of date (run python -m plasmient_trace.schemas): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
