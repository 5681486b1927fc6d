"""Forward passes without gradients of a model being trained: evaluation, generation, a rollout.

They are no training steps, and are counted apart (the report names them) when the model called is
one being trained (it holds an optimizer's parameter, or the one a hand-written loop updates): a
frozen backbone or a distillation teacher is not. Regions are ``no_grad``, ``inference_mode`` and
``set_grad_enabled(False)`` entered with gradients on; a module hook is on only while such a region
is open, and steps aside during each outermost call, so the training step and the modules inside a
pass run without it. Eval mode with gradients on is not told apart: that would need hooks on every
module call of every step.

Counting costs each outermost call a hook's registration and each region its two wrappers (the
report adds their time to autogaudi's own cost). A loop that calls models without gradients more
than once a step on average by step ``EVALUATION_CHECKED_AT_STEP``, in every step or in more regions
than steps (an RL rollout: the policy called per environment step, then several updates; a teacher
called once a step is counted), would pay that all run long, so its regions are left to torch from
there and the report says from which step the count stopped. A loop that evaluates now and then (an
evaluation every few hundred steps, a ``generate()`` at the end) is counted for the whole run.
"""

from __future__ import annotations

import sys
import time
import weakref

import torch

from autogaudi.core.guard import guarded
from autogaudi.core.unit import Scope
from autogaudi.watch import module_hooks
from autogaudi.watch.step_count import BY_BACKWARD

NO_GRAD_REGIONS = (torch.no_grad, torch.inference_mode, torch.set_grad_enabled)
EVALUATION_CHECKED_AT_STEP = 10


class EvaluationPasses:
    """The region watch; ``watch`` is the session's :class:`~autogaudi.watch.steps.TrainingSteps`, asked
    which models train (its optimizers, the parameter a hand-written loop updates) and told when a
    region before training ends (the first step starts after it)."""

    def __init__(self, watch, guard):
        self.watch = watch
        self.passes = 0  # forward passes of a trained model without gradients
        self.counted_until = None  # the step counting them stopped at (a rollout; see the module's docstring)
        self._outermost_calls = 0  # forward passes without gradients seen, of any model
        self._calls_at_last_step = 0
        self._steps_with_calls = 0  # training steps in which some model was called without gradients
        self._regions_with_calls = 0  # regions without gradients in which some model was called
        self._called_in_region = False
        self.own_s = 0.0  # the time its wrappers and hooks took inside the user's calls
        self._regions = Scope(guard)  # the region watch, closed on its own where it costs too much
        self._region = None  # the no_grad, inference_mode or set_grad_enabled(False) that turned gradients off
        self._calls_hook = None  # while in a region: the global hook that sees the next module call
        self._returned_hook = None  # while that call runs: a hook on that module, for its return
        self._guarded_call = guarded(guard, self._module_called)
        self._guarded_return = guarded(guard, self._module_returned)
        self._evaluated = weakref.WeakKeyDictionary()  # module -> passes not yet told trained or not
        self._trained = weakref.WeakKeyDictionary()  # module -> whether it is a model being trained

    def install(self) -> None:
        self.watch.timeline.count_own_work(lambda: self.own_s)
        self._regions.add(module_hooks.keep())  # its hook comes and goes per call: the compiled-call wrapper stays
        for region in NO_GRAD_REGIONS:
            self._regions.wrap(region, "__enter__", self._region_entered)
            self._regions.wrap(region, "__exit__", self._region_left)

    def uninstall(self) -> None:
        self._regions.close()
        self._region = None
        self._stop_watching_module_calls()

    def steps_ended(self, steps: int, now_at: int) -> None:
        """``steps`` training steps ended, the count now ``now_at``: tell the passes so far, and stop
        counting a loop that made passes in every step up to the check."""
        self.tell()
        new_calls = self._outermost_calls - self._calls_at_last_step
        self._calls_at_last_step = self._outermost_calls
        self._steps_with_calls += min(steps, new_calls)
        crossed = now_at >= EVALUATION_CHECKED_AT_STEP > now_at - steps
        often = self._steps_with_calls >= now_at or self._regions_with_calls > now_at
        if crossed and often and self._outermost_calls > now_at and self.counted_until is None:
            self.uninstall()
            self.counted_until = now_at

    def _region_entered(self, wrapped, instance, args, kwargs):
        # set_grad_enabled(False) turns gradients off when made, before it is entered: its ``prev``
        # says what it found. A region inside gradients already off (an optimizer's step) is not one.
        started = time.perf_counter()
        enabled_before = instance.prev if isinstance(instance, torch.set_grad_enabled) else torch.is_grad_enabled()
        own = time.perf_counter() - started
        result = wrapped(*args, **kwargs)
        started = time.perf_counter()
        if self._region is None and enabled_before and not torch.is_grad_enabled() and not compiling():
            self._region = instance
            self._called_in_region = False
            self._watch_module_calls()
        self.own_s += own + time.perf_counter() - started
        return result

    def _region_left(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if instance is self._region:
            started = time.perf_counter()
            self._region = None
            self._stop_watching_module_calls()
            self.watch.region_left()
            self.tell()
            self.own_s += time.perf_counter() - started
        return result

    # Inside a region without gradients one global pre-hook sees the next module call; it steps aside
    # for that call (a hook on that module alone tells when it returns), so the modules inside a pass
    # run on torch's fast path and only its outermost call costs anything.
    def _watch_module_calls(self) -> None:
        if self._calls_hook is None and self._returned_hook is None:
            self._calls_hook = module_hooks.register_forward_pre_hook(self._guarded_call)

    def _stop_watching_module_calls(self) -> None:
        for handle in (self._calls_hook, self._returned_hook):
            if handle is not None:
                handle.remove()
        self._calls_hook = self._returned_hook = None

    def _module_called(self, module, args):
        started = time.perf_counter()
        if compiling() or _inside_a_module_call():  # a region opened inside a forward: no pass of its own
            return
        self._calls_hook.remove()
        self._calls_hook = None
        self._outermost_calls += 1
        self._regions_with_calls += not self._called_in_region
        self._called_in_region = True
        self._returned_hook = module.register_forward_hook(self._guarded_return, always_call=True)
        if not self.watch.in_own_work and not torch.is_grad_enabled():
            self._evaluated[module] = self._evaluated.get(module, 0) + 1
        self.own_s += time.perf_counter() - started

    def _module_returned(self, module, args, output):
        started = time.perf_counter()
        self._returned_hook.remove()
        self._returned_hook = None
        if self._region is not None:
            self._watch_module_calls()
        self.own_s += time.perf_counter() - started

    def tell(self) -> None:
        """Count the passes of the models being trained, once it is known which those are (an
        optimizer stepped, or the loop is counted by its backward passes); a model that was not (a
        teacher, a frozen part) is forgotten. Each model is told apart once (a rollout under no_grad
        in every step must not walk the parameters every step). The timeline marks them."""
        watch = self.watch
        if not self._evaluated or (not watch.optimizers and watch.counted_by != BY_BACKWARD):
            return
        unknown = [module for module in list(self._evaluated.keys()) if module not in self._trained]
        if unknown:
            trained = {
                id(p) for optimizer in watch.optimizers for group in optimizer.param_groups for p in group["params"]
            }
            sentinel = watch.sentinel()
            if sentinel is not None:
                trained.add(id(sentinel))
            for module in unknown:
                self._trained[module] = any(id(param) in trained for param in module.parameters())
        passes = sum(count for module, count in list(self._evaluated.items()) if self._trained.get(module))
        self._evaluated.clear()
        if passes:
            self.passes += passes
            watch.timeline.add_to_mark(watch.steps, "steps", "evaluated", passes=passes)


_CALL_IMPL = torch.nn.Module._call_impl.__code__


def _inside_a_module_call() -> bool:
    """Whether another module's call is under way further up the stack (the module whose hook asks
    is called inside another's forward): its own call is one ``_call_impl`` frame, another's would be
    a second. Read once per outermost call in a region without gradients, never per step."""
    frame, calls = sys._getframe(2), 0
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            calls += 1
            if calls > 1:
                return True
        frame = frame.f_back
    return False


def compiling() -> bool:
    """Inside torch.compile, tracing or compiling a frame: hooks are not added or removed there (the
    compiler guards on the global module hooks it saw, and its own code enters no_grad regions)."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and compiler.is_compiling():
        return True
    guards = sys.modules.get("torch._guards")
    return guards is not None and guards.TracingContext.try_get() is not None
