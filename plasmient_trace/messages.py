"""The one-line error every command prints for bad input, a failed export or an output it cannot write.

A file name is the user's to choose, and may hold a newline or a terminal escape: printed raw, one error
became two lines (a log reader or CI grep saw half of it) or recoloured the terminal. Every error line goes
through :func:`say_error`, which shows such characters escaped."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

__all__ = ["OneLineErrorParser", "one_printable_line", "say_error"]

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def one_printable_line(text: str) -> str:
    """``text`` with every character a terminal would act on (newline, escape, other controls) escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _ESCAPES.get(c, f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}")
                   for c in text)


def say_error(program: str, message: str) -> None:
    """``program: error: message`` on stderr, on one line."""
    print(f"{program}: error: {one_printable_line(message)}", file=sys.stderr)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with its errors on one line: the usage block before them made a bad flag 14 lines of
    output where every other bad input is one. --help still prints the usage. Subcommands inherit it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_printable_line(message)} (see {self.prog} --help)\n")
