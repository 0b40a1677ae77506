"""A live step's input-shape signature: which steps do the same work, so a step at step depth can carry the
FLOPs a full-depth step measured.

A step's signature is the model's class, train/eval mode, grad mode, which of its parameters require
gradients (a layer unfrozen mid-run adds its weight gradients), the shapes and dtypes of the tensors
passed to the step's first module call that takes one and the numbers beside them
(``torch_hooks.input_signature``), the number of backward passes the step ran, plus the
number and shapes of that module's later calls in the step (with gradient accumulation or a ``generate``
loop the first call is the same whatever the step does after it), and the shapes of the calls of the step's
other models (a module named as the root of its own tree: a decoder after an encoder, a loss module), so a
step whose decoder sees another length carries nothing measured on a different one. Keywords are seen only
once a model's call returns (``call_signature``): the shapes in each model's keywords, and which of each other
model's parameters require gradients, join the signature when the step ends, so a step whose keywords differ
from its measured step's carries nothing (``unknown`` until a full-depth step makes the same calls). A
signature never measured sends the rest of its step to full depth (at most ``max_signatures`` of them); the ops the step ran
before that call are recorded from its start where that can happen (``may_measure``) and dropped when it
does not, so the measurement is the whole step's. A step opened at its first module call (step 0, the first step
after an explicit one: ``opened_at_call``) holds nothing from before that call, so its signature is its own
(``OPENED_AT_CALL``): it never gives its shorter count to the steps opened at a boundary, which measure theirs
whole, and it carries only what another step opened at its first call measured. A compiled model is measured on its second call with new
shapes, as its first one compiles. Everything here runs on the training thread, once per call of the
signature's module or of another model, and once per step otherwise.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

from ..records import NEEDS_CONFIRMATION

# Module calls a step may make before one with a tensor argument gives its signature.
SIGNATURE_TRIES = 64
# Later calls of the signature's module whose shapes a step's signature keeps (past it, only their number).
MAX_REPEATS = 4096
# Distinct values a number passed to the signature's module may take at one position before it leaves the
# signature: a decode position is one per step for a while, a global step counter would make every step new.
MAX_NUMBER_VALUES = 8
# A model's parameter list (for which require gradients) is walked again after this many steps.
PARAMETERS_REFRESH = 64

WAIT, STOP, MEASURE = "wait", "stop", "measure"

# The signature of a step opened at its first module call, not at a step boundary: the work before that call
# (a projection outside the model, zero_grad) is in no step, so such a step measured 0.51x a whole step's
# FLOPs with a 512x512 projection before the model, and the boundary steps that carried it carried that.
OPENED_AT_CALL = "|opened at its first module call"


def unwrapped(module: Any) -> Any:
    """The model a ``torch.compile`` wrapper (``OptimizedModule``) wraps, else the module itself: the signature
    names and weighs the user's model, compiled or not."""
    return getattr(module, "_orig_mod", module)


class StepSignatures:
    """The open step's signature, and which signatures were measured at full depth in this session."""

    def __init__(self, max_signatures: int) -> None:
        self.max_signatures = max_signatures
        self.seen: set[str] = set()        # measured at full depth
        self.first_seen: set[str] = set()  # compiled models: seen once (that call compiled), without OPENED_AT_CALL
        self.key: str | None = None        # the open step's first-call signature, once seen
        self._kwargs: list[Any] = []       # the keywords of the step's models' calls
        self._others_trained: dict[int, str] = {}  # id(other model) -> which of its parameters require grad
        self.previous_key: str | None = None  # the last step's: a model whose steps have a signature
        self._tries = 0
        self._repeats: list[Any] = []
        self._others: list[Any] = []  # the shapes of other models' calls after the signature's
        self.backward_passes = 0  # backward passes through a root model's output in the open step
        self.opened_at_call = False  # the open step was opened at its first module call (OPENED_AT_CALL)
        self._numbers: dict[tuple[str, int], set[Any]] = {}  # (model, position) -> values seen there
        self._numbers_left = False
        self._parameters: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()

    def begin(self, opened_at_call: bool = False) -> None:
        self.previous_key = self.key
        self.opened_at_call = opened_at_call
        self.key, self._tries, self._repeats, self._others = None, 0, [], []
        self._kwargs, self._others_trained = [], {}
        self.backward_passes = 0
        self._numbers_left = False  # a number left this step's signature (MAX_NUMBER_VALUES)

    def abort(self) -> None:
        """The open step is dropped (``begin`` again follows): the last step's signature stays the previous one."""
        self.key = self.previous_key

    def may_measure(self) -> bool:
        """Could this step's first module call send it to full depth, with work before that call to record?
        Only where steps have signatures (the last one had), room is left for a new one, and the step opened
        at a boundary (one opened at its first module call has nothing before it)."""
        return not self.opened_at_call and self.previous_key is not None and self._room()

    def _room(self) -> bool:
        """Room for one more measured signature of the open step's kind: at most ``max_signatures`` of steps
        opened at a boundary, and as many of steps opened at their first module call, so step 0's own
        signature never takes the room of the steps after it."""
        at_call = self.opened_at_call
        return sum(k.endswith(OPENED_AT_CALL) == at_call for k in self.seen) < self.max_signatures

    def first_call(self, module: Any, args: Any, full: bool, root: Any = None) -> str:
        """A module call while the step has no signature: WAIT (no tensor argument: show the next call),
        STOP (the signature is taken, or no call had a tensor), or MEASURE (a signature never measured:
        capture the rest of the step at full depth)."""
        import torch

        from .torch_hooks import input_signature  # with torch: the session module loads without it

        shapes = input_signature(args)
        if shapes is None:
            self._tries += 1
            return STOP if self._tries >= SIGNATURE_TRIES else WAIT
        model = unwrapped(module)
        compiled = model is not module
        shapes, left = self._bounded_numbers(type(model).__qualname__, shapes)
        self._numbers_left = self._numbers_left or left
        # the same shapes through another model, in eval mode or without grad are other work; which
        # parameters train is the whole model's (its root, where the first call with a tensor is a layer)
        trained = self._trained(unwrapped(root) if root is not None else model)
        key = self.key = f"{type(model).__qualname__}|{'train' if module.training else 'eval'}|" \
                         f"{'grad' if torch.is_grad_enabled() else 'nograd'}|requires_grad {trained}|{shapes}" \
                         f"{OPENED_AT_CALL if self.opened_at_call else ''}"
        if full:
            self.seen.add(key)
        elif key in self.seen or not self._room():
            pass
        elif compiled and key.removesuffix(OPENED_AT_CALL) not in self.first_seen:
            # a compiled model recompiles on its first call with new shapes: measure the next (step 1 after a
            # step 0 that compiled them, whose signature is its own, runs compiled code already)
            self.first_seen.add(key.removesuffix(OPENED_AT_CALL))
        else:
            self.seen.add(key)
            return MEASURE
        return STOP

    def _bounded_numbers(self, model: str, shapes: tuple) -> tuple[tuple, bool]:
        """``shapes`` with each number past MAX_NUMBER_VALUES values at its position replaced by '*', and
        whether one was."""
        out, left = [], False
        for i, entry in enumerate(shapes):
            if isinstance(entry[0], str):   # a number or a string: (type name, value)
                seen = self._numbers.setdefault((model, i), set())
                if len(seen) <= MAX_NUMBER_VALUES:
                    seen.add(entry[1])
                if len(seen) > MAX_NUMBER_VALUES:
                    entry, left = (entry[0], "*"), True
            out.append(entry)
        return tuple(out), left

    def _trained(self, model: Any) -> str:
        """Which of ``model``'s parameters require gradients, as a short hash; the parameter list is cached
        (walking a large model's modules every step cost 13 ms on 4,800 parameter tensors)."""
        cached = self._parameters.get(model)
        if cached is None or cached[0] >= PARAMETERS_REFRESH:
            cached = [0, list(model.parameters())]
            self._parameters[model] = cached
        cached[0] += 1
        return hashlib.blake2b(bytes(p.requires_grad for p in cached[1]), digest_size=8).hexdigest()

    def backward_pass(self) -> None:
        """A backward pass reached a root model's output (``torch_hooks.ModuleRecorder``)."""
        self.backward_passes += 1

    def repeat(self, args: Any) -> None:
        """Another call of the module that gave the signature."""
        from .torch_hooks import input_signature

        self._repeats.append(input_signature(args) if len(self._repeats) < MAX_REPEATS else None)

    def other_model(self, module: Any, args: Any) -> None:
        """A call of another model after the signature's first (a decoder after an encoder, a loss module): a
        step whose other models see other shapes, or train other parameters, does other work, and carries
        nothing measured without them."""
        from .torch_hooks import input_signature

        self._others.append(input_signature(args) if len(self._others) < MAX_REPEATS else None)
        model = unwrapped(module)
        if id(model) not in self._others_trained:
            self._others_trained[id(model)] = f"{type(model).__qualname__} {self._trained(model)}"

    def model_kwargs(self, module: Any, kwargs: dict) -> None:
        """A model's call returned, with its keywords (the global forward hook: the pre-hook never gets them)."""
        from .call_signature import kwargs_signature

        if len(self._kwargs) >= MAX_REPEATS:
            return
        model = type(unwrapped(module)).__qualname__
        shapes, left = self._bounded_numbers(f"{model}|keywords", kwargs_signature(kwargs))
        self._numbers_left = self._numbers_left or left
        self._kwargs.append((model, shapes))

    def compiled_during(self) -> None:
        """The full-depth step just measured compiled a frame: its ops include the compiler's, so measure
        its signature again on a later call."""
        if self.key is not None:
            self.seen.discard(self.key)
            self.first_seen.add(self.key.removesuffix(OPENED_AT_CALL))

    def finish(self) -> str | None:
        """The signature the step's FLOPs are carried under: a step of two micro-batches never carries
        what a step of four measured, nor one that skipped its backward what a step with one measured, nor
        one whose models were called with other keywords or train other parameters."""
        if self.key is None:
            return None
        key = f"{self.key}|{self.backward_passes} backward"
        if self._repeats:
            calls = hashlib.blake2b(repr(self._repeats).encode(), digest_size=8).hexdigest()
            key = f"{key}|{len(self._repeats)} more calls {calls}"
        if self._others:
            others = hashlib.blake2b(repr(self._others).encode(), digest_size=8).hexdigest()
            key = f"{key}|{len(self._others)} other model calls {others}"
        if self._others_trained:
            trained = hashlib.blake2b(repr(sorted(self._others_trained.values())).encode(), digest_size=8).hexdigest()
            key = f"{key}|other models' requires_grad {trained}"
        if self._kwargs:
            keywords = hashlib.blake2b(repr(self._kwargs).encode(), digest_size=8).hexdigest()
            key = f"{key}|{len(self._kwargs)} calls' keywords {keywords}"
        return key + NEEDS_CONFIRMATION if self._numbers_left else key
