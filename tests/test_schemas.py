"""schemas/ is generated from the code and must not drift from it, and what it states holds on real traces."""

import json
import math

import pyarrow.compute as pc
import pytest

from conftest import ALL_TRACES, ingested

from plasmient_trace import schemas
from plasmient_trace.conventions import SPAN_ATTRIBUTES, SPAN_TABLE_SCHEMA
from plasmient_trace.records import TABLE_SCHEMAS


def test_checked_in_schemas_match_the_code():
    for name, text in schemas.documents().items():
        path = schemas.SCHEMA_DIR / name
        assert path.exists(), f"{path} missing: run python -m plasmient_trace.schemas"
        assert path.read_text() == text, f"{path} is stale: run python -m plasmient_trace.schemas"


def test_every_attribute_is_a_span_table_column_and_documented():
    names = [a.name for a in SPAN_ATTRIBUTES]
    assert len(names) == len(set(names))
    for a in SPAN_ATTRIBUTES:
        assert SPAN_TABLE_SCHEMA.field(a.name).type == a.type
        assert a.description and a.levels


def test_record_tables_document_every_column():
    doc = schemas.records_document()
    for name, schema in TABLE_SCHEMAS.items():
        assert [f["name"] for f in doc["tables"][name]] == schema.names


def _documented_ranges() -> dict[str, tuple[float, float]]:
    """minimum/maximum of each attribute as the checked-in schema states them (what users read)."""
    doc = json.loads((schemas.SCHEMA_DIR / "span_attributes.json").read_text())
    return {a["name"]: (a["minimum"], a.get("maximum", math.inf)) for a in doc["attributes"] if "minimum" in a}


def test_shares_are_bounded_by_one_and_amounts_by_zero_in_the_schema():
    ranges = _documented_ranges()
    assert ranges["plasmient.mfu"] == (0, 1) and ranges["plasmient.util.resident"] == (0, 1)
    assert ranges["plasmient.cost.wasted_usd"] == (0, math.inf) and ranges["plasmient.kernels"] == (0, math.inf)
    # a signed offset, an epoch time and the bus bandwidth share that is not capped (see its description)
    assert "plasmient.clock.offset_ns" not in ranges and "plasmient.device.start_ns" not in ranges
    assert ranges["plasmient.comm.busbw_fraction"] == (0, math.inf)


@pytest.mark.parametrize("name", ALL_TRACES)
def test_every_number_of_a_real_trace_lies_in_its_documented_range(name):
    table = ingested(name).batch.table
    outside = []
    for attribute, (low, high) in _documented_ranges().items():
        column = table.column(attribute)
        if column.null_count == len(column):
            continue
        extremes = pc.min_max(column)
        least, most = extremes["min"].as_py(), extremes["max"].as_py()
        if least < low or most > high + 1e-9:
            outside.append(f"{attribute}: [{least}, {most}] outside [{low}, {high}]")
    assert outside == []
