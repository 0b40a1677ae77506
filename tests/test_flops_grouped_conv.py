"""Grouped, depthwise and transposed convolutions, forward and backward, captured live on a CPU.

The oracle is the convolution's multiply-add count written out here from the shapes: each output element
of a convolution with ``groups`` sums ``C_in / groups * k_h * k_w`` products, so the forward pass does
``2 * N * H_out * W_out * C_out * C_in / groups * k_h * k_w`` FLOPs (a transposed one the same per *input*
element), and each gradient the backward pass computes (input, weight) is one more pass of the same size.
Bias terms are not counted, as torch's FlopCounterMode does not count them.

FlopCounterMode agrees on every forward and on ungrouped backwards. On a grouped backward it counts the weight
gradient ``groups`` times: torch 2.13's ``conv_backward_flop`` ignores its ``groups`` argument (its docstring
skips "some details involving ... groups"), computing the weight gradient as an ungrouped convolution of
the transposed input and output. A depthwise 16-channel layer's backward reads 16x its true cost there.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from capture_helpers import live_capture  # noqa: E402

N, C, HW = 2, 16, 16


def analytic(layer: nn.Module, x) -> float:
    """Forward FLOPs of one conv layer from its shapes (module docstring)."""
    with torch.no_grad():
        out = layer(x)
    c_in_per_group = layer.in_channels // layer.groups
    if isinstance(layer, nn.ConvTranspose2d):  # each input element scatters into C_out/groups * k * k outputs
        return 2.0 * x.shape[0] * math.prod(x.shape[2:]) * layer.in_channels * (layer.out_channels // layer.groups) * math.prod(layer.kernel_size)
    return 2.0 * out.shape[0] * math.prod(out.shape[2:]) * layer.out_channels * c_in_per_group * math.prod(layer.kernel_size)


def captured(layer: nn.Module, x) -> dict[str, float]:
    """The captured FLOPs of the step's convolution ops, by name: forward and backward."""
    with live_capture(close_timeout=60, every=1, peak_tflops=1.0, job_id="grouped-conv") as (session, sink):
        with session.step():
            layer.zero_grad(set_to_none=True)
            layer(x).pow(2).mean().backward()
    assert not session.failed
    out: dict[str, float] = {}
    for r in sink.rows():
        if r["plasmient.level"] == "op" and r["name"] in ("aten::convolution", "aten::convolution_backward"):
            out[r["name"]] = out.get(r["name"], 0.0) + r["plasmient.flops"]
    return out


def flop_counter(layer: nn.Module, x) -> tuple[float, float]:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fwd:
        with torch.no_grad():
            layer(x)
    with FlopCounterMode(display=False) as both:
        layer(x).pow(2).mean().backward()
    return float(fwd.get_total_flops()), float(both.get_total_flops() - fwd.get_total_flops())


LAYERS = {
    "ungrouped": lambda: nn.Conv2d(C, C, 3, padding=1),
    "groups=4": lambda: nn.Conv2d(C, C, 3, padding=1, groups=4),
    "depthwise": lambda: nn.Conv2d(C, C, 3, padding=1, groups=C, bias=False),
    "groups=4, stride 2": lambda: nn.Conv2d(C, 2 * C, 3, stride=2, padding=1, groups=4),
    "transposed, groups=2": lambda: nn.ConvTranspose2d(C, C // 2, 2, stride=2, groups=2),
}


@pytest.mark.parametrize("input_grad", [False, True], ids=["first layer", "inner layer"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_convolution_flops_forward_and_backward_are_the_multiply_adds(kind: str, input_grad: bool) -> None:
    torch.manual_seed(0)
    layer = LAYERS[kind]()
    x = torch.randn(N, C, HW, HW, requires_grad=input_grad)  # a first layer's input needs no gradient
    fwd = analytic(layer, x)
    got = captured(layer, x)
    assert got["aten::convolution"] == pytest.approx(fwd, rel=1e-12)
    # backward: the weight gradient always, the input gradient only when the input needs one
    assert got["aten::convolution_backward"] == pytest.approx(fwd * (1 + input_grad), rel=1e-12)

    fcm_fwd, fcm_bwd = flop_counter(layer, x)
    assert fcm_fwd == fwd
    # FlopCounterMode: the input gradient right, the weight gradient `groups` times over (module docstring)
    assert fcm_bwd == fwd * (input_grad + layer.groups)
