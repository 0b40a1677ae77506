"""schemas/ is generated from the code and must not drift from it."""

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
