"""Typed msgspec schema of a Kineto Chrome trace: only the fields the record tables read are materialised.

msgspec skips every other key inside the C decoder (stack frames, python_function ids, flow events'
extra args, ...), so decoding an event builds one small Struct instead of a dict per event plus a
dict per ``args``. A gzip'd file's events are decoded a chunk of whole events at a time
(``event_chunks``); a document read whole keeps them as ``Raw`` views of its bytes, each decoded when its
turn comes. Field types are ``Any`` where real files disagree (pid/tid are ints in new Kineto,
strings in old files; ts is int or float): the loop in ``kineto.py`` interprets them exactly as the
previous dict-based parser did, and numpy rejects what is not a number.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from msgspec import UNSET, Struct, field


class KinetoArgs(Struct, gc=False):
    """The ``args`` keys any record table uses; UNSET tells "absent" from an explicit null."""

    external_id: Any = field(default=UNSET, name="External id")
    external_id_lower: Any = field(default=None, name="external id")
    sequence_number: Any = field(default=None, name="Sequence number")
    fwd_thread_id: Any = field(default=None, name="Fwd thread id")
    # An op's argument lists stay JSON text: a trace repeats a few thousand of them, so the reader parses
    # each distinct one once (kineto._ArgTexts) instead of building lists per op to print them back. None
    # when absent; an explicit null is the text "null" (msgspec takes no union with Raw).
    input_dims: msgspec.Raw = field(default=None, name="Input Dims")
    input_types: msgspec.Raw = field(default=None, name="Input type")
    concrete_inputs: msgspec.Raw = field(default=None, name="Concrete Inputs")
    input_strides: msgspec.Raw = field(default=None, name="Input Strides")
    flops: Any = None
    device: Any = UNSET
    stream: Any = UNSET
    correlation: Any = None
    grid: Any = None
    block: Any = None
    registers_per_thread: Any = field(default=None, name="registers per thread")
    shared_memory: Any = field(default=None, name="shared memory")
    graph_id: Any = field(default=None, name="graph id")
    bytes: Any = None
    # Inductor (benchmark_kernel / profile_bandwidth) annotates its Triton kernels with these.
    kernel_flop: Any = None
    kernel_num_gb: Any = None
    # NCCL/RCCL metadata PyTorch's c10d records (record_param_comms); current Kineto copies it onto the kernel.
    collective_name: Any = field(default=None, name="Collective name")
    in_msg_nelems: Any = field(default=None, name="In msg nelems")
    out_msg_nelems: Any = field(default=None, name="Out msg nelems")
    group_size: Any = field(default=None, name="Group size")
    comm_dtype: Any = field(default=None, name="dtype")
    process_group_name: Any = field(default=None, name="Process Group Name")


class KinetoEvent(Struct, gc=False):
    ph: Any = None
    cat: Any = None
    name: Any = None
    # never a boolean, which array("d") took as 1 us; a string (which the events the reader ignores may
    # carry) is refused where an event is used, by the typed column it goes into
    ts: float | str | None = None
    dur: float | str | None = None
    pid: Any = None
    tid: Any = None
    args: KinetoArgs | None = None


class KinetoDocument(Struct, gc=False):
    """The top level. Events stay undecoded ``Raw`` views into the file's bytes (about 50 bytes each):
    each is decoded into a :class:`KinetoEvent` only when its turn comes and dropped right after, so
    the per-event objects never all exist at once."""

    traceEvents: list[msgspec.Raw] | msgspec.UnsetType = UNSET
    deviceProperties: Any = None
    baseTimeNanoseconds: Any = None
    distributedInfo: Any = None


# A bare JSON array of events is also a valid Chrome trace.
DOCUMENT = msgspec.json.Decoder(KinetoDocument | list[msgspec.Raw])
EVENT = msgspec.json.Decoder(KinetoEvent)
TOP_LEVEL_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])


class MalformedEvent(Exception):
    """An event of valid JSON whose fields have the wrong types: ``index`` in the document, msgspec's
    ``what``, and the field ``at``."""

    def __init__(self, index: int, what: str, at: str) -> None:
        super().__init__(f"event #{index}: malformed event ({what} at {at})")
        self.index, self.what, self.at = index, what, at


_AT = re.compile(r"^\$(?:\[(\d+)\])?\.?(.*)$")


def malformed_event(err: msgspec.ValidationError, first: int, in_list: bool) -> MalformedEvent | None:
    """msgspec's type error as the event it names: decoding one event (``$.field``), the event numbered
    ``first``; decoding a list of events (``$[i].field``), the i-th after ``first``. None where the path
    names no event of the list."""
    what, _, where = str(err).partition(" - at ")
    found = _AT.match(where.strip("`"))
    item, field = (found.group(1), found.group(2)) if found else (None, "")
    if in_list and item is None:
        return None
    return MalformedEvent(first + (int(item) if in_list else 0), what, field or "the event")
