"""Per-op labels (an op's dtype, its FLOP model's name) stored as small codes into a few distinct names.

A rank's ops carry one dtype and one model name each, out of about ten of either. As numpy unicode
arrays they cost 20-44 bytes an op (over 160 MB at 2.7M ops, held for the whole stitch) and every
comparison or copy walks that text; as codes they cost 4 bytes and compare as integers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..grouping import first_seen_groups, group_rows

_MIX = np.int64(-7046029254386353131)  # 0x9E3779B97F4A7C15, an odd 64-bit constant (wraps)


def unicode_to_arrow(values: np.ndarray) -> pa.Array:
    """A numpy unicode array as an Arrow string array. ASCII (dtype and model names) is converted from the
    fixed-width code points in a few vectorised passes (pa.array walks it element by element)."""
    values = np.asarray(values)
    width = values.dtype.itemsize // 4
    if values.dtype.kind != "U" or width == 0 or len(values) == 0:
        return pa.array(values.astype(str), pa.string())
    points = values.view(np.uint32).reshape(len(values), width)
    if points.max() >= 128:
        return pa.array(values, pa.string())
    # numpy pads with NUL code points at the end only, so the non-NUL points are each string's text
    keep = points != 0
    offsets = np.zeros(len(values) + 1, np.int32)
    np.cumsum(keep.sum(axis=1), out=offsets[1:])
    data = points[keep].astype(np.uint8)
    return pa.Array.from_buffers(pa.string(), len(values), [None, pa.py_buffer(offsets), pa.py_buffer(data)])


@dataclass(frozen=True)
class Labels:
    """One label per row: ``names[codes[i]]``."""

    codes: np.ndarray  # int32, one per row
    names: np.ndarray  # unicode, the distinct labels

    @classmethod
    def encode(cls, values: np.ndarray | Iterable[str]) -> Labels:
        """From a unicode array (or any sequence of str), by hashing (no sort over the rows): ASCII text
        is packed eight characters to an int64 and the rows grouped on those integers."""
        values = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=str)
        n, width = len(values), values.dtype.itemsize // 4
        points = values.view(np.uint32).reshape(n, width) if n and width else None
        if points is None or points.max() >= 128:
            enc = pc.dictionary_encode(pa.array(values, pa.string()))
            names = np.asarray(enc.dictionary.to_pylist(), dtype=values.dtype if n else "<U1")
            return cls(codes=enc.indices.to_numpy(zero_copy_only=False).astype(np.int32), names=names)
        packed = np.zeros((n, -(-width // 8) * 8), np.uint8)
        packed[:, :width] = points
        words = packed.view(np.int64)
        del packed
        # One hash per row; a collision (two texts, one key) is caught by comparing every row's words with
        # its group's first row, and then the words are grouped exactly, column by column.
        key = words[:, 0].copy()
        for i in range(1, words.shape[1]):
            key ^= words[:, i] * _MIX + i
        group, first = first_seen_groups(key)
        if words.shape[1] > 1 and not np.array_equal(words[first][group], words):
            group, first = group_rows([first_seen_groups(np.ascontiguousarray(words[:, i]))[0]
                                       for i in range(words.shape[1])])
        return cls(codes=group.astype(np.int32), names=values[first])

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, rows: np.ndarray | slice) -> Labels:
        return Labels(codes=self.codes[rows], names=self.names)

    def isin(self, names: Iterable[str]) -> np.ndarray:
        """Per row: is its label one of ``names``."""
        return np.isin(self.names, list(names))[self.codes]

    def equals(self, name: str) -> np.ndarray:
        """Per row: is its label ``name``."""
        return self.isin([name])

    def decode(self) -> np.ndarray:
        """The labels as a unicode array."""
        return self.names[self.codes]

    def to_arrow(self) -> pa.Array:
        """The labels as an Arrow string array."""
        return pa.DictionaryArray.from_arrays(pa.array(self.codes), unicode_to_arrow(self.names)).cast(pa.string())


def as_labels(values: np.ndarray | Labels) -> Labels:
    return values if isinstance(values, Labels) else Labels.encode(values)


class LabelColumn:
    """Per-row labels as codes that a pass may rewrite in place (the context pass relabels some ops), so a
    10^6-row table of model names is never held as text."""

    def __init__(self, names_of_groups: Iterable[str], group_of_row: np.ndarray) -> None:
        """Row i labelled ``names_of_groups[group_of_row[i]]`` (a few hundred signatures' names, one group per
        signature, spread over a million ops)."""
        self.names: list[str] = []
        self._code: dict[str, int] = {}
        self.codes = self.codes_of(names_of_groups)[np.asarray(group_of_row, np.int64)]

    def code_of(self, name: str) -> int:
        """The code of ``name``, added to the names if new."""
        code = self._code.get(name)
        if code is None:
            code = self._code[name] = len(self.names)
            self.names.append(name)
        return code

    def codes_of(self, names: Iterable[str]) -> np.ndarray:
        return np.array([self.code_of(x) for x in names], np.int32)

    def equals(self, name: str) -> np.ndarray:
        """Per row: is its label ``name``."""
        code = self._code.get(name)
        return np.zeros(len(self.codes), bool) if code is None else self.codes == code

    def labels(self) -> Labels:
        return Labels(codes=self.codes, names=np.array(self.names, dtype=str) if self.names else np.zeros(0, "<U1"))
