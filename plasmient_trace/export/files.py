"""What every output writer asks of a path before it writes or removes one: is it a special file (a device,
a FIFO, a socket) that is written in place, and which of the files it wrote may it take back."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

__all__ = ["is_special_file", "remove_written_files"]


def is_special_file(path: str | os.PathLike[str]) -> bool:
    """An existing path that is neither a regular file nor a directory: /dev/null, a FIFO, a socket, a
    terminal. Such a path is written in place: never renamed over, never removed, nothing put beside it."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return False  # not there yet: the file the run will write
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def remove_written_files(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Take back the outputs a failed run wrote (all the outputs or none): regular files only, so that an
    output that was /dev/stdout or a FIFO is never unlinked; one that is already gone is no error."""
    for path in paths:
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(Path(path)).st_mode):
                os.unlink(path)
