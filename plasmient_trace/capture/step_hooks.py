"""The torch hooks that mark live step boundaries and share the profiler with the job.

* An optimizer step ends a step: torch's global post hook sees it, and a wrapper around each profiled
  optimizer class's ``step`` moves the boundary after torch's ``Optimizer.step#<cls>.step`` scope, so the
  scope and the optimizer's ops stay in their step. Classes are wrapped when the session starts and as torch
  hooks them (at a class's first instance), so even the first step ends outside its scope.
* ``torch.profiler.profile.step`` ends a step; while the job's own profiler runs, CUPTI and the Kineto
  fallback stand aside (one activity client per process) and resume when it stops.

Every patch is recorded in ``session._patched`` with what it replaced; ``CaptureSession.close`` restores
them, and each wrapper keeps ``__wrapped__``.
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import TYPE_CHECKING, Any

from .config import say_once

if TYPE_CHECKING:
    from .session import CaptureSession

# Steps in a row, with the clock optimizer silent, after which another optimizer is the clock (unless some
# optimizer has stepped more often than half of that between two clock steps before: a WGAN's critic).
TAKEOVER_RUN = 8


def install(session: CaptureSession, torch: Any) -> None:
    """The optimizer post hook, the optimizer wrappers and the profiler patches."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    session._opt_hook = register_optimizer_step_post_hook(functools.partial(optimizer_stepped, session))
    wrap_optimizers(session, torch)
    prof_cls = torch.profiler.profile
    original = prof_cls.step

    @functools.wraps(original)  # keeps __wrapped__, as instrumentors do
    def step(self_prof: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self_prof, *args, **kwargs)
        session.mark_step("profiler")
        return out

    prof_cls.step = step
    session._patched.append((prof_cls, "step", original))
    # One CUPTI activity client per process: while the user's torch.profiler (Kineto) runs,
    # ours (if any) steps aside, and resumes when it stops. Those steps' kernels are in its trace.
    hooks = (("start", functools.partial(suspend_cupti, session)), ("stop", functools.partial(resume_cupti, session)))
    for name, hook in hooks:
        orig = getattr(prof_cls, name)

        @functools.wraps(orig)
        def wrapped(self_prof: Any, *a: Any, _orig: Any = orig, _hook: Any = hook, _name: str = name, **k: Any) -> Any:
            if getattr(self_prof, "_plasmient_own", False):  # our Kineto fallback's own run
                return _orig(self_prof, *a, **k)
            if _name == "start":
                _hook()
                return _orig(self_prof, *a, **k)
            out = _orig(self_prof, *a, **k)
            _hook()
            return out

        setattr(prof_cls, name, wrapped)
        session._patched.append((prof_cls, name, orig))


def suspend_cupti(session: CaptureSession) -> None:
    session._user_profilers += 1
    if session.sources.kineto is not None:
        yield_kineto(session)
    try:
        if session.sources.cupti is not None and session.sources.cupti.available:
            session.sources.cupti.stop()
            say_once("cupti-kineto", "torch.profiler started: CUPTI is Kineto's until it stops; steps meanwhile "
                                     "carry no kernels here (ingest the profiler's trace for them)")
    except Exception as err:
        session._fail("cupti", err)


def resume_cupti(session: CaptureSession) -> None:
    session._user_profilers = max(session._user_profilers - 1, 0)
    try:
        if session.sources.cupti is not None and not session.sources.cupti.available:
            session.sources.cupti.start()
    except Exception as err:
        say_once("cupti-resume", f"CUPTI not resumed after torch.profiler: {err}")


def say_kineto_stands_aside() -> None:
    """Once: the job's own torch.profiler holds Kineto, so the fallback's full-depth steps go without kernels."""
    say_once("kineto-user", "torch.profiler started by the job: the Kineto fallback stands aside until it "
                            "stops; full-depth steps meanwhile carry ops without kernels (ingest its trace for them)")


def yield_kineto(session: CaptureSession) -> None:
    """The job's torch.profiler is starting: Kineto is one per process, so ours stands aside (the
    open step keeps its ops through the dispatch hooks, without kernels)."""
    say_kineto_stands_aside()
    try:
        with session._lock:
            if session.sources.kineto.running:
                session.sources.kineto.abort()
                if session._open and session._full and not session.failed:
                    session._enter_mode()
    except Exception as err:
        session._fail("kineto", err)


def optimizer_stepped(session: CaptureSession, optimizer: Any, args: Any, kwargs: Any) -> None:
    # With several optimizers (GANs, per-group optimizers) the first one that steps is the step clock, so
    # one iteration is one step. Another optimizer takes over when it steps more often in a row than another
    # optimizer ever did between two clock steps (at least TAKEOVER_RUN times): a replacement, whether the old
    # one is gone or kept alive (a head trained alone, then the whole model with a new optimizer: every later
    # step was lost while the old one lived). A WGAN critic stepping 5 times a generator step never does; the
    # replacement's first steps until it takes over are one step.
    try:
        clock = session._opt_clock() if session._opt_clock is not None else None
        if clock is optimizer or clock is None:
            if clock is None:
                session._opt_clock = weakref.ref(optimizer)
            session._opt_longest_run = max(session._opt_longest_run, session._opt_rival_steps)
            session._opt_rival, session._opt_rival_steps = None, 0
        else:
            rival = session._opt_rival() if session._opt_rival is not None else None
            if rival is not optimizer:
                session._opt_rival, session._opt_rival_steps = weakref.ref(optimizer), 0
            session._opt_rival_steps += 1
            if session._opt_rival_steps < max(TAKEOVER_RUN, 2 * session._opt_longest_run + 1):
                return
            session._opt_clock, session._opt_rival = weakref.ref(optimizer), None
            session._opt_rival_steps = session._opt_longest_run = 0
    except TypeError:
        pass
    if session._opt_wrapped_depth:
        return  # the wrapper marks the boundary once torch's Optimizer.step# scope has closed
    wrap_optimizer_class(session, type(optimizer))  # a class torch hooked before we could see it
    session.mark_step("optimizer")


def wrap_optimizers(session: CaptureSession, torch: Any) -> None:
    """Wrap every optimizer class torch has hooked, now and as it hooks more (at a class's first
    instance, ``Optimizer._patch_step_function``), so even the first step ends after its scope."""
    base = torch.optim.Optimizer
    pending, seen = [base], set()
    while pending:
        cls = pending.pop()
        if cls not in seen:
            seen.add(cls)
            wrap_optimizer_class(session, cls)
            pending.extend(cls.__subclasses__())
    original = base.__dict__.get("_patch_step_function")
    if original is None:
        return  # another torch: classes are wrapped at their first step, which then ends inside its scope

    @functools.wraps(original)
    def patch_step_function(opt: Any) -> None:
        original(opt)
        wrap_optimizer_class(session, type(opt))

    base._patch_step_function = patch_step_function
    session._patched.append((base, "_patch_step_function", original))


def drop_own_frame(err: BaseException) -> None:
    """Take the calling wrapper's frame out of the traceback of ``err``, which the wrapper caught, so that
    the wrapper's bare ``raise`` (which adds no frame) passes on the traceback the job prints untraced:
    an exception in an optimizer's step showed a line of step_hooks.py between the job's and torch's."""
    tb = err.__traceback__
    if tb is not None and tb.tb_frame is sys._getframe(1):
        err.__traceback__ = tb.tb_next


def wrap_optimizer_class(session: CaptureSession, cls: Any) -> None:
    """Move the step boundary outside torch's ``Optimizer.step#<cls>.step`` record_function. The
    post hook runs inside that scope, so a step ending there cut the scope off from its step: the
    span was missing and the optimizer's ops sat flat under the step. A wrapper around the class's
    (already profiled) ``step`` marks the boundary after the scope closes; ``hooked`` is kept so
    torch does not wrap it again."""
    current = cls.__dict__.get("step")
    if current is None or not getattr(current, "hooked", False) or getattr(current, "_plasmient", False):
        return

    @functools.wraps(current)
    def step(opt: Any, *args: Any, **kwargs: Any) -> Any:
        session._opt_wrapped_depth += 1
        try:
            return current(opt, *args, **kwargs)
        except BaseException as err:
            drop_own_frame(err)
            raise  # bare: adds no frame of ours back
        finally:
            session._opt_wrapped_depth -= 1
            clock = session._opt_clock() if session._opt_clock is not None else None
            if clock is opt and not session._opt_wrapped_depth:
                session.mark_step("optimizer")

    step.hooked = True  # type: ignore[attr-defined]
    step._plasmient = True  # type: ignore[attr-defined]
    cls.step = step
    session._patched.append((cls, "step", current))
