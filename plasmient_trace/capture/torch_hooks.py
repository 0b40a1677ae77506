"""Torch-side live capture: ops through the native RecordFunction observer (or, where it cannot be
built, a TorchDispatchMode), nn.Module calls through global hooks.

Two op recorders with one interface (``__enter__``/``__exit__`` around a full-depth step,
``take()`` at its end, ``table(chunks, pid, epoch)`` on the worker thread, ``failed``, ``notice``):

* :class:`NativeOpRecorder` (default): the C++ ``at::RecordFunction`` callback of
  ``op_observer.cpp``, which sees every op Kineto sees (composite and aten ops, autograd nodes with
  their sequence numbers, ``record_function`` scopes) for about a microsecond each.
* :class:`OpRecorder`: a TorchDispatchMode, which sees every aten op below autograd with its real
  arguments but costs tens of microseconds of Python per op; used where no C++ compiler is found.

Both can bracket each op with a CUPTI external correlation id so the kernels it launches join to it
exactly. Global module hooks see every ``nn.Module.__call__`` without touching the model. On the hot
path everything only appends records; turning them into Arrow tables (names, JSON shapes, epoch
timestamps) happens later, off the training thread, in the ``table`` methods / :func:`.packed_tables.modules_table`.

Backward module spans are not recorded here: the stitcher rebuilds them from the autograd sequence
number (a backward op carries the sequence number of the forward op that created its node), which
needs no backward hooks and so leaves the autograd graph exactly as the user built it.
"""

from __future__ import annotations

import threading
import time
import weakref
from time import perf_counter_ns
from typing import Any, Callable, Iterator

import pyarrow as pa
import torch
from torch.utils._python_dispatch import TorchDispatchMode


_get_native_id = threading.get_native_id
# True while dynamo traces a frame. The module hooks return at once then: dynamo inlines global
# hooks into the graph it builds, and a hook that touches Python state there (the path cache, the
# per-thread stack) either breaks the graph or fails the compile ("already tracked for mutation").
# Compiled regions still show up as their ops and kernels; only their inner module spans are absent.
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
_current_node = torch._C._current_autograd_node
_get_seq = torch._C._autograd._get_sequence_nr
_Tensor = torch.Tensor
_SEQ_NONE = 1 << 63  # AccumulateGrad and friends report UINT64_MAX: no forward op
_NO_OUTPUT = object()  # what _post's output is when torch calls it without kwargs (forward raised)

from .packed_tables import SHAPE_ONLY_OPS, SignatureTable  # noqa: F401 - SHAPE_ONLY_OPS: named here by native.py
from .op_tables import TENSOR_LIST, ops_table



def _meta(values: Any) -> list[Any]:
    """What an op's arguments look like, without holding on to any tensor (that would pin memory)."""
    out: list[Any] = []
    for a in values:
        if isinstance(a, _Tensor):
            out.append((a.shape, a.dtype))
        elif isinstance(a, (list, tuple)) and a and isinstance(a[0], _Tensor):
            out.append((TENSOR_LIST, [tuple(t.shape) if isinstance(t, _Tensor) else () for t in a]))
        elif a is None or isinstance(a, (bool, int, float, str)):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.append(tuple(x if isinstance(x, (bool, int, float)) else str(x) for x in a))
        else:
            out.append(str(a))
    return out


class OpRecorder(TorchDispatchMode):
    """Records every aten op that runs while it is entered; optionally brackets it with a CUPTI
    external correlation id (``push(id)`` before, ``pop()`` after) so its kernels join to it exactly.

    Record layout (one tuple per op): (func, start_ns, end_ns, thread, sequence_nr, backward,
    external_id, args meta). Timestamps are ``perf_counter_ns``; :func:`ops_table` maps them to epoch.
    """

    def __init__(self, push: Callable[[int], Any] | None = None, pop: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self._push = push
        self._pop = pop
        self._next_id = 1
        self._last_seq = _get_seq()
        self.failed: BaseException | None = None
        self.notice: str | None = None  # the dispatch hook has nothing to say once; see NativeOpRecorder
        self.limit = 0  # records kept between two take()s (0: all); past it ops are counted, not kept
        self._over = 0
        self.taken_over = 0  # ops the last take() did not get for the limit

    def take(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        self.taken_over, self._over = self._over, 0
        return ops

    def set_correlation(self, push: Callable[[int], Any] | None, pop: Callable[[], Any] | None) -> None:
        self._push, self._pop = push, pop

    @property
    def next_id(self) -> int:
        return self._next_id

    @next_id.setter
    def next_id(self, value: int) -> None:
        self._next_id = value

    @staticmethod
    def table(chunks: list[list[tuple]], pid: int, epoch_offset_ns: int) -> pa.Table:
        return ops_table([o for c in chunks for o in c], pid, epoch_offset_ns)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None,  # noqa: ANN001 - torch's signature
                           _clock=perf_counter_ns, _node=_current_node, _seq=_get_seq, _tid=_get_native_id,
                           _Tensor=_Tensor):
        # Hot path (once per aten op): globals are bound as defaults, tensors reduced to (shape, dtype).
        if kwargs is None:
            kwargs = {}
        if self.limit and len(self.ops) >= self.limit:
            self._over += 1  # counted, not recorded: the step goes out at step depth
            return func(*args, **kwargs)
        eid = self._next_id
        self._next_id = eid + 1
        push = self._push
        if push is not None:
            push(eid)
            try:
                t0 = _clock()
                out = func(*args, **kwargs)
                t1 = _clock()
            finally:
                self._pop()
        else:
            t0 = _clock()
            out = func(*args, **kwargs)
            t1 = _clock()
        # Bookkeeping errors must never reach the user's op: keep the first for the session to report
        # once, and skip this op's record.
        try:
            node = _node()
            if node is None:
                # Autograd created this op's node (and took a sequence number) before dispatching to
                # us; an op that needs no gradient took none, so an unchanged counter means "no node".
                now = _seq()
                seq = now - 1 if now != self._last_seq else -1
                self._last_seq = now
                backward = False
            else:
                seq = node._sequence_nr()
                if seq >= _SEQ_NONE:
                    seq = -1
                backward = True
            meta = []
            add = meta.append
            for a in args:
                if isinstance(a, _Tensor):
                    add((a.shape, a.dtype))
                elif type(a) is list or type(a) is tuple:
                    add(_meta((a,))[0])  # may hold tensors (cat, stack): never keep those alive
                else:
                    add(a)  # scalars, None, dtypes, devices: small, kept as they are
            if kwargs:
                meta += _meta(kwargs.values())
            self.ops.append((func, t0, t1, _tid(), seq, backward, eid, meta))
        except Exception as err:  # pragma: no cover - defensive, reported by the session
            if self.failed is None:
                self.failed = err
        return out


class NativeOpRecorder:
    """Ops through the native observer (``native.load()``'s module): a global RecordFunction callback
    added when a full-depth step begins and removed when it ends, so other steps cost nothing.

    A chunk (``take()``) is the observer's packed columns; signatures (name, JSON dims/types/
    concrete inputs) are numbered once by the observer and fetched here as they appear, so a step's
    table is a ``take`` on the signature table, not a string per op. Ops in
    :data:`SHAPE_ONLY_OPS` are dropped there.
    """

    def __init__(self, observer: Any) -> None:
        self._obs = observer
        self._errors_seen = observer.errors()
        self.failed: BaseException | None = None
        self.notice: str | None = None  # something the session should say once (not an error)
        self._limit = 0
        self.taken_over = 0  # ops the last take() did not get for the limit
        self._sig_lock = threading.Lock()
        self.signatures = SignatureTable(observer.SCOPE_USER)

    def __enter__(self) -> "NativeOpRecorder":
        self._obs.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._obs.stop()  # a no-op in a fork()ed child, whose copy of torch's callback lock may be held for good
        errors = self._obs.errors()
        if errors > self._errors_seen and self.failed is None:
            self.failed = RuntimeError(f"{errors - self._errors_seen} op records skipped: {self._obs.first_error()}")
        self._errors_seen = errors
        if self.notice is None and self._obs.unspelled():
            self.notice = (f"over {self._obs.MAX_SIGNATURES} distinct op signatures (shapes keep changing): "
                           "ops with new signatures are recorded by name only, without shapes or FLOPs")

    @property
    def limit(self) -> int:
        return self._limit

    @limit.setter
    def limit(self, records: int) -> None:
        self._limit = int(records)
        self._obs.set_limit(self._limit)

    def take(self) -> dict[str, bytes]:
        chunk = self._obs.take()
        self.taken_over = int(chunk.pop("over_limit", 0))
        return chunk

    def settle(self, timeout_s: float) -> None:
        """Wait, at most ``timeout_s``, for the async ops begun while recording (a collective's work on a
        process group's thread) to end: gloo wakes the training thread before it ends the op, and one
        still open when the observer stops is never recorded (see op_observer.cpp's g_async_open)."""
        open_ops = getattr(self._obs, "async_open", None)  # an observer built before it: nothing to wait for
        if open_ops is None or not open_ops():
            return
        deadline = time.perf_counter() + timeout_s
        while open_ops() and time.perf_counter() < deadline:
            time.sleep(0.0001)

    def set_correlation(self, push_address: int | None, pop_address: int | None) -> None:
        """C function pointers (``cuptiActivityPush/PopExternalCorrelationId``); None clears them."""
        self._obs.set_correlation(push_address or 0, pop_address or 0)

    @property
    def next_id(self) -> int:
        return int(self._obs.next_id())

    @next_id.setter
    def next_id(self, value: int) -> None:
        self._obs.set_next_id(int(value))

    def signature_table(self) -> "SignatureTable":
        """The signatures the observer has numbered so far (fetching those new since the last call)."""
        with self._sig_lock:
            new = self._obs.signatures(self.signatures.size)
            if new:
                self.signatures.extend([list(col) for col in zip(*new)])
            return self.signatures

    def table(self, chunks: list[dict[str, bytes]], pid: int, epoch_offset_ns: int) -> pa.Table:
        return self.signature_table().table(chunks, pid, epoch_offset_ns)


class ModuleRecorder:
    """nn.Module forward calls as (thread, start, end, name) records, named by their path in the model.

    The record's ``name`` is the path *relative to the enclosing recorded module*, because the
    stitcher builds the full dotted path by nesting in time (parent path + '.' + name). The outermost
    module of a model is named by its class (``TinyLM``; a second live model of the class ``TinyLM#2``),
    its children by ``named_modules()`` (``TinyLM.layers.0.attn`` in full).
    """

    def __init__(self, on_forward: Callable[[], None] | None = None,
                 on_signature: Callable[[torch.nn.Module, Any], None] | None = None,
                 on_repeat: Callable[[Any], None] | None = None,
                 on_root: Callable[[torch.nn.Module, Any], None] | None = None,
                 on_backward: Callable[[], None] | None = None,
                 on_kwargs: Callable[[torch.nn.Module, dict], None] | None = None) -> None:
        self.records: list[tuple] = []
        self.enabled = False
        self._on_forward = on_forward
        # While set, every module call is shown to on_signature (the session clears it once it has the
        # step's input signature): one attribute test per call at step depth.
        self.want_signature = False
        self._on_signature = on_signature
        # The module that gave the step's signature: its later calls in the step (micro-batches, a generate
        # loop) are shown to on_repeat, so a step that calls it another number of times, or with other
        # shapes, does not carry the FLOPs of one that did not. One identity test per call.
        self.repeat_module: torch.nn.Module | None = None
        self._on_repeat = on_repeat
        # Once the step has its signature, the calls of every other model (a module first seen at the top of
        # the stack: a second tower, a decoder, a loss module) are shown to on_root, so their shapes join it.
        self.watch_roots = False
        self._roots: set[int] = set()  # ids of modules named as the root of their tree
        self._on_backward = on_backward
        self._on_root = on_root
        # While a step is open, the keywords a model (a root, or torch.compile's wrapper) was called with are
        # shown to on_kwargs when its call returns: the global pre-hook never gets them (``call_signature``).
        self.watch_kwargs = False
        self._on_kwargs = on_kwargs
        self._paths: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
        self._named: dict[str, weakref.ref] = {}  # a model's name -> the model that holds it
        self._local = threading.local()
        self._handles: list[Any] = []
        self._warning_filter: Any = None
        self.failed: BaseException | None = None
        self.limit = 0  # records kept between two take()s (0: all); past it calls are counted, not kept
        self._over = 0
        self.taken_over = 0

    def install(self) -> None:
        import warnings

        from torch.nn.modules import module as m

        # torch warns that global hooks fire once more for a torch.compile wrapper; the hooks are
        # ours, the user did nothing to act on, and the wrapper is skipped in _pre/_post below.
        warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks",
                                category=UserWarning)
        self._warning_filter = warnings.filters[0]
        self._handles = [m.register_module_forward_pre_hook(self._pre),
                         m.register_module_forward_hook(self._post, with_kwargs=True, always_call=True)]

    def uninstall(self) -> None:
        import warnings

        from torch.nn.modules import module as m

        for h in self._handles:
            h.remove()
            # A handle's remove() leaves its id in torch's with_kwargs set, which keeps
            # _has_any_global_hook() true for the life of the process: every later torch.compile(module)
            # call would warn about global hooks that are gone.
            getattr(m, "_global_forward_hooks_with_kwargs", {}).pop(h.id, None)
        self._handles = []
        if self._warning_filter is not None:
            try:
                warnings.filters.remove(self._warning_filter)  # the user's own global hooks warn as before
            except ValueError:
                pass  # the user reset the filters since
            # warnings remembers where it ignored a warning until the filters change: say they did
            mutated = getattr(warnings, "_filters_mutated", None)
            if mutated is not None:
                mutated()
            self._warning_filter = None

    def take(self) -> list[tuple]:
        recs, self.records = self.records, []
        self.taken_over, self._over = self._over, 0
        return recs

    def reset_stack(self) -> None:
        self._local = threading.local()

    def _stack(self) -> list:
        st = getattr(self._local, "stack", None)
        if st is None:
            st = self._local.stack = []
        return st

    def path_of(self, module: torch.nn.Module, parent_path: str | None) -> str:
        path = self._paths.get(module)
        if path is not None:
            return path
        # First sight of a model (or of a module built on the fly): name its whole subtree once.
        base = type(module).__name__ if parent_path is None else f"{parent_path}.{type(module).__name__}"
        root = self._free_name(base, module)
        if parent_path is None:
            self._roots.add(id(module))
            # a freed model's id may be reused by a submodule, whose calls would then join the signature
            weakref.finalize(module, self._roots.discard, id(module))
        for name, sub in module.named_modules():
            if sub not in self._paths:
                self._paths[sub] = f"{root}.{name}" if name else root
        return self._paths[module]

    def root_of(self, module: torch.nn.Module) -> torch.nn.Module | None:
        """The model ``module`` was named under (the root of its tree), when it was named and is alive."""
        path = self._paths.get(module)
        ref = self._named.get(path.split(".", 1)[0]) if path is not None else None
        return ref() if ref is not None else None

    def _free_name(self, base: str, module: torch.nn.Module) -> str:
        """``base``, or ``base#2``, ``base#3``... while another live model holds it: an encoder and a decoder of
        one class get two names, so their layers are told apart; a model rebuilt after the last one was freed
        takes its name back."""
        n = 1
        while True:
            name = base if n == 1 else f"{base}#{n}"
            ref = self._named.get(name)
            holder = ref() if ref is not None else None
            if holder is None or holder is module:
                self._named[name] = weakref.ref(module)
                return name
            n += 1

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if _compiling():
            return None
        if self._on_forward is not None:
            try:
                self._on_forward()
            except Exception as err:  # pragma: no cover - defensive
                self.failed = self.failed or err
        if module is self.repeat_module and self._on_repeat is not None:
            try:
                self._on_repeat(args)
            except Exception as err:  # pragma: no cover - defensive
                self.failed = self.failed or err
        elif self.want_signature and self._on_signature is not None:
            try:
                self._on_signature(module, args)
            except Exception as err:  # pragma: no cover - defensive
                self.failed = self.failed or err
        elif self.watch_roots and self._on_root is not None and (
                id(module) in self._roots
                # at full depth a model seen for the first time is named a root below, when no call is open
                or (self.enabled and module not in self._paths and not self._stack())):
            try:
                self._on_root(module, args)
            except Exception as err:  # pragma: no cover - defensive
                self.failed = self.failed or err
        if not self.enabled or type(module).__name__ == "OptimizedModule":
            return None  # torch.compile's wrapper: its original module is recorded under its own name
        try:
            st = self._stack()
            parent = st[-1][1] if st else None
            st.append((module, self.path_of(module, parent), perf_counter_ns(), parent))
        except Exception as err:  # pragma: no cover - defensive
            self.failed = self.failed or err
        return None

    def _post(self, module: torch.nn.Module, args: Any, kwargs: Any, output: Any = _NO_OUTPUT) -> None:
        # First, before any of this recorder's state is read: dynamo traces global hooks into a compiled
        # module's frame, and every attribute read before this check became a guard of that frame (the roots'
        # ids, whether recording is on), so the job's model recompiled as they changed, up to dynamo's cache
        # limit, after which it ran uncompiled with a warning in the job's stderr.
        if _compiling():
            return None
        if output is _NO_OUTPUT:  # torch calls an always_call hook without kwargs when forward raised
            kwargs, output = None, kwargs
        if self.watch_roots and self._on_backward is not None and id(module) in self._roots:
            self._count_backward_of(output)
        if self.watch_kwargs and kwargs and self._on_kwargs is not None and (
                id(module) in self._roots or type(module).__name__ == "OptimizedModule"):
            try:
                self._on_kwargs(module, kwargs)
            except Exception as err:  # pragma: no cover - defensive
                self.failed = self.failed or err
        if not self.enabled or type(module).__name__ == "OptimizedModule":
            return None
        try:
            t1 = perf_counter_ns()
            st = self._stack()
            if not st or st[-1][0] is not module:
                # Recording started inside this module's forward (or an exception unwound past us).
                while st and st[-1][0] is not module:
                    st.pop()
                if not st:
                    return None
            _, path, t0, parent = st.pop()
            if parent is not None and path.startswith(parent + "."):
                name = path[len(parent) + 1:]
            else:
                name = path
            if self.limit and len(self.records) >= self.limit:
                self._over += 1
            else:
                self.records.append((_get_native_id(), t0, t1, name))
        except Exception as err:  # pragma: no cover - defensive
            self.failed = self.failed or err
        return None

    def _count_backward_of(self, output: Any) -> None:
        """A backward pass through a root model's output runs its autograd node: a pre-hook on it counts the
        step's backward passes for its signature (no patch of torch.autograd, which torch.compile would
        trace into)."""
        try:
            node = _grad_fn_of(output)
            if node is not None:
                node.register_prehook(self._backward_reached)
        except Exception as err:  # pragma: no cover - defensive
            self.failed = self.failed or err

    def _backward_reached(self, grad_outputs: Any) -> None:
        try:
            self._on_backward()  # type: ignore[misc]
        except Exception as err:  # pragma: no cover - defensive
            self.failed = self.failed or err
        return None


def _leaves(value: Any, width: int, max_depth: int, max_visits: int) -> Iterator[Any]:
    """The values in ``value`` in order, looking into tuples, lists and dict values (their first ``width``
    items, ``max_depth`` levels, ``max_visits`` values and containers in all); a container past the depth is
    a leaf."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    visited = 0
    while stack and visited < max_visits:
        value, depth = stack.pop()
        visited += 1
        if depth < max_depth and isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in reversed(value[:width]))
        elif depth < max_depth and isinstance(value, dict):
            stack.extend((v, depth + 1) for v in reversed(list(value.values())[:width]))
        else:
            yield value


def _grad_fn_of(output: Any) -> Any:
    """The autograd node of the first tensor of a module's output that has one (a tensor, a tuple or list, a
    dict or a ModelOutput), or None."""
    for value in _leaves(output, width=8, max_depth=3, max_visits=1024):   # every node 3 levels of 8 hold
        if isinstance(value, _Tensor) and value.grad_fn is not None:
            return value.grad_fn
    return None


def input_signature(args: Any, limit: int = 32, max_depth: int = 4) -> tuple | None:
    """Shapes and dtypes of the tensors in a call's arguments, in order, looking into tuples, lists and
    dict values (at most ``limit`` tensors, ``max_depth`` levels), and the values of the numbers and short
    strings beside them (a decode loop's position, ``forward(tokens, start_pos)``, decides how much of a
    KV cache held in buffers its attention reads); None when there is no tensor. Steps with equal
    signatures through the same module do the same work, so they share one FLOP count. Runs on the
    training thread once per step, outside any dynamo trace (the caller returns first)."""
    out: list[tuple] = []
    tensors = 0
    for value in _leaves(args, width=limit, max_depth=max_depth, max_visits=8 * limit):
        if isinstance(value, _Tensor):
            tensors += 1
            out.append((tuple(value.shape), str(value.dtype).replace("torch.", "")))
            if tensors >= limit:
                break
        elif isinstance(value, (int, float, str)):   # bool is an int
            out.append((type(value).__name__, value if not isinstance(value, str) else value[:64]))
    return tuple(out) if tensors else None


# ---------------------------------------------------------------------------------------------
# Records -> Arrow tables (off the training thread)
