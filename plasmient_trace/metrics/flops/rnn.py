"""Recurrent layers run as one op: the oneDNN LSTM layer a CPU runs for ``nn.LSTM`` (``aten::mkldnn_rnn_layer``
and its backward). Its math happens inside the op, not in child ops, so without a formula a CPU run counted
none of its time as work (only the bias add it calls) and none of its FLOPs.

Counted as torch's own unrolled cell (``aten::lstm_cell``: two linears, their sum, the gates) would be
counted op by op, for T·B rows (time steps × batch) of a layer with G = 4H gate rows:
  2·T·B·G·(I + H) for the two GEMMs, T·B·G per bias, T·B·G to add the two products,
  9·T·B·H for the cell (3 sigmoid, 1 tanh on the gates, c = f·c + i·g, h = o·tanh(c)).
The backward counts twice the forward, as a GEMM with both gradients does (oneDNN computes the input,
weight and state gradients whatever autograd needs). Bytes: every tensor argument read once, outputs
written once. Other recurrent ops (cuDNN/MIOpen ``_cudnn_rnn``, ``miopen_rnn``) are not modelled: on a GPU
their kernels count as unknown FLOPs.
"""

from __future__ import annotations

from .core import FlopResult, OpArgs, _prod, _reg

# cuDNN's mode numbers, which the oneDNN layer is passed too: only LSTM runs there.
_LSTM_MODE = 2
_GATES_PER_UNIT = 4
_CELL_FLOPS_PER_UNIT = 9


def _lstm_layer_flops(a: OpArgs, mode_arg: int) -> tuple[float, int, int] | None:
    """(forward FLOPs, T·B, H) of one LSTM layer op; None when the record does not determine them."""
    x, w_ih, w_hh = a.shape(0), a.shape(1), a.shape(2)
    if x is None or w_ih is None or w_hh is None or len(w_ih) != 2 or len(w_hh) != 2:
        return None
    (gates, i_size), (gates_hh, h_size) = w_ih, w_hh
    mode = a.value(mode_arg)
    if gates != gates_hh or gates != _GATES_PER_UNIT * h_size or (mode is not None and mode != _LSTM_MODE):
        return None
    if not x or x[-1] != i_size or i_size == 0:
        return None
    rows = _prod(x) // i_size  # time steps x batch, in either layout
    biases = sum(1 for k in (3, 4) if a.is_tensor(k) and a.numel(k) == gates)
    flops = rows * (2.0 * gates * (i_size + h_size) + (biases + 1) * gates + _CELL_FLOPS_PER_UNIT * h_size)
    return flops, rows, h_size


def _mkldnn_lstm(a: OpArgs) -> FlopResult:
    # mkldnn_rnn_layer(input 0, w_ih 1, w_hh 2, b_ih 3, b_hh 4, hx 5, cx 6, reverse 7, batch_sizes 8, mode 9, ...)
    layer = _lstm_layer_flops(a, mode_arg=9)
    if layer is None:
        return None
    flops, rows, h_size = layer
    read = sum(a.nbytes(k) for k in range(7))
    written = (rows * h_size + 2 * a.numel(5)) * a.es(0)  # output, hy, cy
    return flops, read + written, "gemm"


def _mkldnn_lstm_backward(a: OpArgs) -> FlopResult:
    # mkldnn_rnn_layer_backward(input 0, w_ih 1, w_hh 2, b_ih 3, b_hh 4, hx 5, cx 6, output 7, hy 8, cy 9,
    #   grad_output 10, grad_hy 11, grad_cy 12, reverse 13, mode 14, ...): writes the gradients of 0-6
    layer = _lstm_layer_flops(a, mode_arg=14)
    if layer is None:
        return None
    flops = layer[0]
    read = sum(a.nbytes(k) for k in range(13))
    written = sum(a.nbytes(k) for k in range(7))
    return 2.0 * flops, read + written, "gemm"


_reg(["aten::mkldnn_rnn_layer"], _mkldnn_lstm)
_reg(["aten::mkldnn_rnn_layer_backward"], _mkldnn_lstm_backward)
