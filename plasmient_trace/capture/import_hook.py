"""A one-shot import hook: run a callback right after a named module has executed, without importing it.

Used to start the capture when the program imports torch (``autostart``) and to set Inductor's kernel
naming when the program imports Inductor's config (``inductor_kernels``): neither imports the module itself.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any, Callable


class AfterImport(importlib.abc.MetaPathFinder):
    """Lets the real finders locate ``name``, then calls ``then(module)`` once the module has executed.
    Fires at most once: it leaves ``sys.meta_path`` at the first import of ``name`` (or at ``disarm``)."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name = name
        self.then = then

    def arm(self) -> None:
        sys.meta_path.insert(0, self)

    def disarm(self) -> None:
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        self.disarm()
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original, then = loader.exec_module, self.then

        def exec_module(module: Any) -> None:
            original(module)
            then(module)

        loader.exec_module = exec_module
        return spec
