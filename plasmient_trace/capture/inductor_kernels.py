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

import os
import sys
from typing import Any

from .import_hook import AfterImport

CONFIG_MODULE = "torch._inductor.config"
ENV_VAR = "TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE"


class InductorKernelNames:
    """install() / uninstall() the kernel-naming setting for one capture session; never raises."""

    def __init__(self, environ: Any = os.environ) -> None:
        self.environ = environ
        self._watcher: AfterImport | None = None
        self._config: Any = None      # Inductor's cpp config, once we set it
        self._found: Any = None       # its value before

    def install(self) -> None:
        if ENV_VAR in self.environ:
            return  # the job chose
        module = sys.modules.get(CONFIG_MODULE)
        if module is not None:
            self.apply(module)
        elif self._watcher is None:
            self._watcher = AfterImport(CONFIG_MODULE, self.apply)
            self._watcher.arm()

    def apply(self, module: Any) -> None:
        try:
            cpp = module.cpp
            self._found = cpp.enable_kernel_profile
            cpp.enable_kernel_profile = True
            self._config = cpp
        except Exception:
            self._config = None  # another torch's config: its kernels stay unnamed

    def uninstall(self) -> None:
        if self._watcher is not None:
            self._watcher.disarm()
            self._watcher = None
        cpp, self._config = self._config, None
        if cpp is None:
            return
        try:
            if cpp.enable_kernel_profile is True:  # the job did not change it since
                cpp.enable_kernel_profile = self._found
        except Exception:
            pass


def frames_compiled() -> int:
    """Frames torch.compile has traced in this process (0 before dynamo is loaded). A full-depth step
    during which it traced recorded the compiler's own (fake-tensor) ops too: not a measurement to carry."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    try:
        return int(utils.counters["frames"]["total"])
    except Exception:
        return 0
