"""What a model's keyword arguments look like, for a step's signature (``capture.signature``).

torch's global forward pre-hook is given a call's positional arguments only; its global forward hook, with
``with_kwargs=True``, is given the keywords too, once the call returns. A model called with keywords only
(Hugging Face's ``model(input_ids=..., past_key_values=...)``, diffusers' ``unet(sample=...)``) is seen there:
the shapes of the tensors its keywords hold, looking into tuples, lists, dicts and the attributes of other
objects (a KV cache object's tensors), and the numbers and short strings beside them. A step whose keywords
differ from those of the full-depth step it would carry from then carries nothing from it.

Bounded (it runs on the training thread once per call of a model): at most ``LIMIT`` tensors, ``MAX_DEPTH``
levels, ``MAX_VISITS`` values and the first ``WIDTH`` items of each container. No user code runs here: an
object's attributes are read from its ``__dict__``, not through properties or ``len()``.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

LIMIT = 32
MAX_DEPTH = 6
MAX_VISITS = 256
WIDTH = 32


def kwargs_signature(kwargs: dict[str, Any]) -> tuple:
    """``(("=", name), entries...)`` per keyword: a tensor as ``(shape, dtype)``, a number, string or None as
    ``(type name, value)``, a module or another object as ``("object", type name)`` followed by what its
    attributes hold."""
    import torch

    from torch import nn

    tensor = torch.Tensor
    out: list[tuple] = []
    stack: list[tuple[Any, int]] = [(v, 0) for v in reversed(list(islice(kwargs.items(), WIDTH)))]
    tensors = visited = 0
    while stack and visited < MAX_VISITS and tensors < LIMIT:
        value, depth = stack.pop()
        visited += 1
        if depth == 0:
            name, value = value
            out.append(("=", str(name)))
        if isinstance(value, tensor):
            tensors += 1
            out.append((tuple(value.shape), str(value.dtype).replace("torch.", "")))
        elif value is None or isinstance(value, (bool, int, float)):
            out.append((type(value).__name__, value))
        elif isinstance(value, str):
            out.append(("str", value[:64]))
        elif depth >= MAX_DEPTH:
            out.append(("object", type(value).__qualname__))
        elif isinstance(value, (list, tuple)):
            out.append(("items", len(value)))
            stack.extend((v, depth + 1) for v in reversed(value[:WIDTH]))
        elif isinstance(value, dict):
            out.append(("items", len(value)))
            stack.extend((v, depth + 1) for v in reversed(list(islice(value.values(), WIDTH))))
        else:
            out.append(("object", type(value).__qualname__))
            attributes = getattr(value, "__dict__", None)
            # a module's parameters do not change with the step; its submodules' state is not an argument
            if isinstance(attributes, dict) and not isinstance(value, nn.Module):
                stack.extend((v, depth + 1) for v in reversed(list(islice(attributes.values(), WIDTH))))
    return tuple(out)
