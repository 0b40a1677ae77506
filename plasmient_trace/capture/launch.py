"""``python -m plasmient_trace.capture.launch train.py [args]`` (or ``-m pkg.module``): trace one script.

The capture is armed before the script runs and starts when it imports torch; the script itself is
run exactly as ``python train.py`` would (``__main__``, its own sys.argv and sys.path[0]).
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        raise SystemExit(2)
    from . import autostart

    autostart.install()
    if args[0] == "-m" and len(args) > 1:
        sys.argv = [args[1]] + args[2:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        script = args[0]
        sys.argv = args
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
