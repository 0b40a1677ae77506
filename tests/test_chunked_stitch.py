"""A trace stitched a group of steps at a time is the trace stitched whole, span for span and id for id, on every
shared trace; each part of the stream holds whole traces; `plasmient ingest` writes the parts as they come and
leaves no file behind when a later group fails.

The whole-rank numbers that cross step boundaries (a pipelined step's early kernels in the previous step's tile,
concurrent kernels of two steps sharing the device, the launch queue) are measured once over the rank
(stitch.timeline), so cutting the rank into groups must not change them: the oracle is the unchunked stitch.
"""

from __future__ import annotations

import os

import orjson
import pytest
from conftest import trace_path
from ingest_checks import assert_same_trace

import plasmient_trace.stitch.tree as tree
from plasmient_trace.cli import main
from plasmient_trace.pipeline import IngestOptions, ingest_paths, ingest_stream

SINGLE = ("v100/resnet50_training.json.gz", "a100/cuda_graphs_rank0_of16.json.gz",
          "a100/nccl_training_rank0_of2.json.gz", "mi300x/resnet_act_checkpoint_rank0_of8.json.gz",
          "mi250/minitoy_train.json.gz", "h100/qwen1.5_0.5b_chat_inference.json.gz", "cpu_only/rank-34.json.gz",
          "cc94_vllm_decode/graph_execution.json.gz")
MULTI = ("a100_multirank/rank-0.json.gz", "a100_multirank/rank-1.json.gz")
WHOLE = 10**12   # every step in one group


def _ingest(names: tuple[str, ...], chunk_rows: int, **options) -> object:
    return ingest_paths([trace_path(n) for n in names], IngestOptions(job_id="chunks", chunk_rows=chunk_rows, **options))


@pytest.mark.parametrize("names", [(n,) for n in SINGLE] + [MULTI], ids=lambda n: n[0].split("/")[0] + "/" + n[0].split("/")[-1][:24])
@pytest.mark.parametrize("max_spans", [None, 60])
def test_one_step_per_group_gives_the_whole_trace(names, max_spans):
    extra = {"max_spans": max_spans} if max_spans else {}
    assert_same_trace(_ingest(names, 1, **extra), _ingest(names, WHOLE, **extra))


def test_the_stream_cuts_between_steps_and_each_part_holds_whole_traces():
    path = trace_path("v100/resnet50_training.json.gz")
    whole = ingest_paths([path], IngestOptions(job_id="chunks", chunk_rows=WHOLE))
    rows_per_step = whole.stats["spans"] // whole.stats["traces"]
    stream = ingest_stream([path], IngestOptions(job_id="chunks", chunk_rows=2 * rows_per_step))
    parts = list(stream.parts)
    assert 2 <= len(parts) < whole.stats["traces"]  # several steps per group, several groups
    seen: set[bytes] = set()
    for part in parts:
        traces = set(part.table.column("trace_id").to_pylist())
        assert not traces & seen, "a trace was split between two parts"
        seen |= traces
        levels = part.table.column("plasmient.level").to_pylist()
        assert levels.count("fleet") == len(traces)  # each trace's fleet span came with it
    assert len(seen) == whole.stats["traces"] == stream.stats["traces"]
    assert sum(len(p) for p in parts) == whole.stats["spans"] == stream.stats["spans"]


def _tiny_steps(tmp_path, steps: int = 20_000):
    """A CPU trace of ``steps`` steps of one aten::mm each."""
    events = []
    for s in range(steps):
        t = 1000.0 + 10 * s
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1, "ts": t, "dur": 9})
        events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": t + 1, "dur": 5,
                       "args": {"Input Dims": [[64, 64], [64, 64]], "Input type": ["float", "float"]}})
    path = tmp_path / "tiny_steps.json"
    path.write_bytes(orjson.dumps({"traceEvents": events}))
    return path


def test_a_part_holds_at_most_chunk_rows_spans_even_when_steps_are_tiny(tmp_path):
    """20,000 steps of one op each: most spans are the steps' own (fleet, node, rank, step). A group is sized by
    them too, so no part holds more spans than ``chunk_rows`` (sized by the ops alone, the parts held 25,000
    spans each at chunk_rows=10,000)."""
    stream = ingest_stream([_tiny_steps(tmp_path)], IngestOptions(job_id="tiny", chunk_rows=10_000))
    sizes = [len(part) for part in stream.parts]
    assert sum(sizes) == stream.stats["spans"] == 20_000 * 5
    assert max(sizes) <= 10_000 and len(sizes) >= 10, sizes


def _lines(path) -> list[bytes]:
    return sorted(path.read_bytes().splitlines())


def test_ingest_writes_the_same_lines_in_groups(tmp_path, capsys):
    path = trace_path("a100/cuda_graphs_rank0_of16.json.gz")
    for name, flags in (("whole", ["--chunk-rows", str(WHOLE)]), ("default", []), ("groups", ["--chunk-rows", "1"])):
        assert main(["ingest", str(path), "--out", str(tmp_path / f"{name}.jsonl"), "--quiet", "--job-id", "g", *flags]) == 0
    whole = _lines(tmp_path / "whole.jsonl")
    assert len(whole) == 5  # one line per step
    assert whole == _lines(tmp_path / "default.jsonl") == _lines(tmp_path / "groups.jsonl")  # byte for byte
    assert all(orjson.loads(line)["resourceSpans"] for line in whole)


def test_by_default_a_group_is_a_part_of_the_input_and_at_least_5000_records(tmp_path):
    """The default group bounds memory by a part of the input, not by a fixed count a mid-size trace never
    reaches. cuda_graphs holds 33,287 records in 5 steps of about 6,600: a group may hold a quarter of them
    (8,326 rows with the step spans), less than two steps, so every step is a group of its own. 20,000 tiny
    steps (one op and its CPU kernel each; 120,000 rows with the spans every step has) are cut into groups of
    12,000 rows (CHUNK_ROWS_AMORTISED, under a quarter of the input; a sixteenth is 7,500): 10 parts of 10,000
    spans."""
    path = trace_path("a100/cuda_graphs_rank0_of16.json.gz")
    stream = ingest_stream([path], IngestOptions(job_id="chunks"))
    parts = list(stream.parts)
    records = sum(getattr(r, kind).num_rows for r in stream.records for kind in ("kernels", "ops", "modules"))
    assert records == 33_287
    assert len(parts) == stream.stats["traces"] == 5
    assert all(part.table.column("plasmient.level").to_pylist().count("step") == 1 for part in parts)

    tiny = ingest_stream([_tiny_steps(tmp_path)], IngestOptions(job_id="tiny"))
    sizes = [len(part) for part in tiny.parts]
    assert len(sizes) == 10 and sum(sizes) == tiny.stats["spans"] == 100_000, sizes


def test_a_group_that_fails_leaves_no_output_file(tmp_path, capsys, monkeypatch):
    """The first group is written before the second is stitched; when the second fails, the partial file is
    removed and the error is one line."""
    stitched = []
    real = tree.stitch_steps

    def second_fails(prepared, s0, s1, *args):
        stitched.append((s0, s1))
        if len(stitched) == 2:
            raise ValueError("step 2 is broken")
        return real(prepared, s0, s1, *args)

    monkeypatch.setattr(tree, "stitch_steps", second_fails)
    out = tmp_path / "out" / "traces.jsonl"
    code = main(["ingest", str(trace_path("v100/resnet50_training.json.gz")), "--out", str(out), "--quiet",
                 "--chunk-rows", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "step 2 is broken" in err, err
    assert stitched[:2] == [(0, 1), (1, 2)]
    assert not out.exists() and not [p for p in os.listdir(out.parent) if p.endswith(".tmp")]


@pytest.mark.parametrize("kept", [[5, 6, 7, 9, 12], [3, 40_000, 90_000, 250_000]], ids=["narrow", "spread"])
def test_a_chunk_renumbers_the_rows_it_kept_and_only_those(kept):
    """A chunk's joins point at its own rows: a kept row becomes its position among the kept ones, anything
    else (-1, rows of other chunks before, between and after) becomes -1. Narrow and spread-out row sets
    take different paths; the oracle is a dict."""
    import numpy as np

    from plasmient_trace.stitch.chunks import _renumber
    kept_a = np.array(kept, np.int64)
    old = np.array([-1, 0, *kept, kept[0] + 1, kept[-1] + 1, 10**6, kept[1]], np.int64)
    position = {row: i for i, row in enumerate(kept)}
    assert _renumber(old, kept_a).tolist() == [position.get(r, -1) for r in old.tolist()]
    assert _renumber(old, np.zeros(0, np.int64)).tolist() == [-1] * len(old)


def test_a_chunk_finds_its_rows_even_when_steps_interleave_in_row_order():
    """StepRows hands each chunk its rows in ascending row order, whatever order the rank's rows come in
    (rows outside every step, -1, belong to no chunk); the oracle is a scan of the step array."""
    from types import SimpleNamespace

    import numpy as np

    from plasmient_trace.stitch.chunks import StepRows
    rng = np.random.default_rng(7)
    steps = {kind: rng.integers(-1, 6, size=n) for kind, n in (("module", 40), ("op", 300), ("kernel", 200))}
    steps["kernel"][:50] = np.sort(steps["kernel"][:50])  # a time-ordered run beside shuffled rows
    index = StepRows.of(SimpleNamespace(module_step=steps["module"], op_step=steps["op"], kernel_step=steps["kernel"]))
    for kind, step in steps.items():
        for s0, s1 in ((0, 1), (1, 4), (0, 6), (5, 6), (6, 7)):
            assert index.within(kind, s0, s1).tolist() == np.flatnonzero((step >= s0) & (step < s1)).tolist()
