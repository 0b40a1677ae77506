"""Inductor's fused CPU kernels as ops: while a capture runs, code Inductor generates for a CPU opens a
RecordFunction in each kernel (``torch._inductor.config.cpp.enable_kernel_profile``), so the op observer
records ``graph_0_cpp_fused_gelu_0`` beside the extern GEMMs it calls. Without it a compiled CPU step's
fused norms, activations and losses were no op at all: their time was not the device's busy time.

Only code compiled while the capture runs is affected, and only its profiling hooks (a RecordFunction
costs nothing without a callback); results are unchanged. ``torch._inductor.config`` is not imported for
this (1 s): the setting is made when the job imports it, through a one-shot import hook. A job that sets
``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE`` itself (``0`` to keep its kernels unnamed) is left as it is,
and ``uninstall`` puts back the value it found.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

CONFIG_MODULE = "torch._inductor.config"
ENV_VAR = "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE"


class _ConfigWatcher(importlib.abc.MetaPathFinder):
    """Lets the real finders locate Inductor's config, then names the kernels once it has executed."""

    def __init__(self, owner: InductorKernelNames) -> None:
        self.owner = owner

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != CONFIG_MODULE:
            return None
        self.owner.disarm()
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module
        owner = self.owner

        def exec_module(module: Any) -> None:
            original(module)
            owner.apply(module)

        loader.exec_module = exec_module
        return spec


class InductorKernelNames:
    """install() / uninstall() the kernel-naming setting for one capture session; never raises."""

    def __init__(self, environ: Any = os.environ) -> None:
        self.environ = environ
        self._watcher: _ConfigWatcher | None = None
        self._config: Any = None      # Inductor's cpp config, once we set it
        self._found: Any = None       # its value before

    def install(self) -> None:
        if ENV_VAR in self.environ:
            return  # the job chose
        module = sys.modules.get(CONFIG_MODULE)
        if module is not None:
            self.apply(module)
        elif self._watcher is None:
            self._watcher = _ConfigWatcher(self)
            sys.meta_path.insert(0, self._watcher)

    def apply(self, module: Any) -> None:
        try:
            cpp = module.cpp
            self._found = cpp.enable_kernel_profile
            cpp.enable_kernel_profile = True
            self._config = cpp
        except Exception:
            self._config = None  # another torch's config: its kernels stay unnamed

    def disarm(self) -> None:
        if self._watcher is not None:
            sys.meta_path[:] = [f for f in sys.meta_path if f is not self._watcher]
            self._watcher = None

    def uninstall(self) -> None:
        self.disarm()
        cpp, self._config = self._config, None
        if cpp is None:
            return
        try:
            if cpp.enable_kernel_profile is True:  # the job did not change it since
                cpp.enable_kernel_profile = self._found
        except Exception:
            pass
