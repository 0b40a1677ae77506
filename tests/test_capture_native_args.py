"""The native op observer records bool lists the way Kineto's "Concrete Inputs" does, so
convolution_backward's output_mask reaches the FLOP model: a first conv whose input needs no
gradient costs one backward GEMM-equivalent, not two (oracle: torch's FlopCounterMode)."""

from __future__ import annotations

import numpy as np
import orjson
import torch
from torch.utils.flop_counter import FlopCounterMode

from plasmient_trace.capture import torch_hooks
from plasmient_trace.metrics import flops as F


def test_conv_backward_output_mask_is_recorded_and_costed(native_observer) -> None:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
    x = torch.randn(2, 3, 16, 16)  # an input: no gradient wanted

    def step() -> None:
        conv(x).sum().backward()

    step()
    rec = torch_hooks.NativeOpRecorder(native_observer)
    with rec:
        step()
    ops = rec.table([rec.take()], pid=1, epoch_offset_ns=0)
    names = ops.column("name").to_pylist()
    row = names.index("aten::convolution_backward")
    concrete = orjson.loads(ops.column("concrete_inputs")[row].as_py())
    assert concrete[-1] == "[False, True, False]"  # grad_input not wanted, grad_weight wanted, no bias

    costs = F.model_ops(ops)
    with FlopCounterMode(display=False) as fc:
        conv(x).sum().backward()
    fwd = names.index("aten::convolution")
    assert costs.flops[fwd] + costs.flops[row] == fc.get_total_flops()
    assert costs.flops[row] == costs.flops[fwd]  # the weight gradient only

    # A second call with another mask is another signature, not the first one's cached spelling.
    x.requires_grad_(True)
    with rec:
        step()
    again = rec.table([rec.take()], pid=1, epoch_offset_ns=0)
    rows = np.array(again.column("name").to_pylist()) == "aten::convolution_backward"
    masks = {orjson.loads(c)[-1] for c, r in zip(again.column("concrete_inputs").to_pylist(), rows) if r}
    assert masks == {"[True, True, False]"}
