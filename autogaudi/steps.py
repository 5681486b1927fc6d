r"""Where the training steps are: every backward pass and every optimizer step, seen once.

Several units need the same moments (HPU step marks, throughput, the step profiler), so the
session watches them once and emits them as :class:`~autogaudi.events.Event`\ s:
``torch.autograd.backward`` is wrapped (``loss.backward()`` and ``scaler.scale(loss).backward()``
both go through it), and so is ``torch.autograd.grad`` (a pass that hands its gradients back; one
with ``create_graph=True`` is part of a larger computation, a gradient penalty or an inner loop, and
is no pass of its own); optimizer steps come from torch's own ``register_optimizer_step_post_hook``,
which fires for every optimizer, including ``GradScaler.step`` and ``step(closure)``. Timing reads
the clock at step boundaries and adds no device synchronisation.

A *training step* is one iteration of the user's loop: a step of one optimizer, the pacer (the first
to step; a GAN's two optimizers or forward-forward's per-layer ones make one iteration one step; the
pacer passes to another optimizer that steps ``REPACE_AFTER`` times in a row without it). A loop that
updates its parameters by hand (no ``torch.optim`` step after ``NO_OPTIMIZER_AFTER`` backward passes)
has its steps counted by backward passes, the ones before that point included once it is known; where
its gradients are cleared only every k passes (accumulation), k passes make one step. An optimizer that
steps later takes over the count. Backward passes that are not the loop's own are not counted: those
inside an optimizer step (LBFGS's closure), inside another backward pass (reentrant checkpointing), and
autogaudi's own (:meth:`TrainingSteps.unseen`); the report names each count.

Forward passes without gradients (``no_grad``, ``inference_mode``, ``set_grad_enabled(False)``: an
evaluation loop, a rollout, generation) are no steps either, and are counted apart when the model
called is one being trained (it holds an optimizer's parameter, or the one a hand-written loop
updates): a frozen backbone or a distillation teacher is not. A module hook is on only while such a
region is open, and steps aside during each outermost call, so the training step and the modules
inside a pass run without it. Eval mode with gradients on is not told apart: that would need hooks
on every module call of every step.

The first step is timed from the last batch fetched before the first backward pass (its forward,
lazy initialisation included), or from the session's start where no DataLoader feeds the loop;
``Timeline.first_step_from`` says which.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import statistics
import sys
import time
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import dataloader

from autogaudi import guard, module_hooks
from autogaudi.events import Event
from autogaudi.guard import guarded
from autogaudi.timeline import Timeline
from autogaudi.unit import Scope

# What the step watcher patches (dotted owner.attribute), besides torch's optimizer-step hooks.
TARGETS = (
    "torch.autograd.backward",
    "torch.autograd.grad_mode.no_grad.__enter__",
    "torch.autograd.grad_mode.no_grad.__exit__",
    "torch.autograd.grad_mode.inference_mode.__enter__",
    "torch.autograd.grad_mode.inference_mode.__exit__",
    "torch.autograd.grad_mode.set_grad_enabled.__enter__",
    "torch.autograd.grad_mode.set_grad_enabled.__exit__",
    "torch.autograd.grad",
    "torch.utils.data.dataloader._BaseDataLoaderIter.__next__",
    "torch.utils.data.DataLoader.__init__",
    "torch.utils.data.DataLoader.__iter__",
)
NO_OPTIMIZER_AFTER = 16  # backward passes with no optimizer step before backward passes count as steps
REPACE_AFTER = 8  # steps of another optimizer in a row, the pacer silent, before it paces instead
BY_OPTIMIZER, BY_BACKWARD = "optimizer steps", "backward passes"
NO_GRAD_REGIONS = (torch.no_grad, torch.inference_mode, torch.set_grad_enabled)
# Counting forward passes without gradients costs each one a hook's registration (tens of
# microseconds); a loop that makes them in every step (an RL rollout: the policy called per
# environment step) would pay it per call. After this many steps, a loop that made more such passes
# than steps stops being counted, and the report says from which step.
EVALUATION_CHECKED_AT_STEP = 10
LEAF_SEARCH = 64  # autograd nodes searched from the loss for a parameter whose gradient tells accumulation apart
_LOADER_SIGNATURE = inspect.signature(dataloader.DataLoader.__init__)


def loader_arguments(loader, args: tuple, kwargs: dict, defaults: bool = False):
    """The arguments of a DataLoader constructor call (``Event.LOADER_BUILT``) by name: those the
    script gave (with ``defaults``, every one); None for a call that does not bind (DataLoader
    raises its own error)."""
    try:
        bound = _LOADER_SIGNATURE.bind(loader, *args, **kwargs)
    except TypeError:
        return None
    if defaults:
        bound.apply_defaults()
    return {name: value for name, value in bound.arguments.items() if name != "self"}


def clock() -> float:
    """The clock step boundaries and batch waits are timed by (seconds), and the step profiler's,
    loader_workers', fused_optimizer's update and the doctor's measurements with them; tests replace
    it to decide on given times (the ``step_clock`` fixture). Not the trials' (``trials.clock``):
    a test that steadies the trials' clock must see only the trials read it."""
    return time.perf_counter()


class TrainingSteps:
    def __init__(self, backend, options, events, guard):
        self.backend = backend
        self.options = options
        self.events = events  # the session's Dispatcher: what this watcher sees, it emits there
        self.backwards = 0  # the user's backward passes (and torch.autograd.grad calls), all of them
        self.backwards_in_optimizer_steps = 0  # of which inside an optimizer step: step(closure)
        self.own_backwards = 0  # autogaudi's own (unseen()), and passes inside another pass: not the loop's
        self.optimizer_steps = 0
        self.steps = 0  # training steps: iterations of the user's loop
        self.counted_by = None  # BY_OPTIMIZER or BY_BACKWARD once the first step is seen
        self._pacer = None  # weak reference to the optimizer whose steps are the training steps
        self._others_in_a_row = 0
        self._step_frames: list = []  # steps under way: backward passes in step(closure) (LBFGS) are not steps
        self._routes = weakref.WeakKeyDictionary()  # DataLoader iterator -> the iterator yielding its batches
        self._scope = Scope(guard)  # its code inside the user's calls fails open through the session
        self._timed_from = None  # (step number, clock) once warm-up is over
        self.last_step_clock = None
        self._unseen = 0  # > 0 while autogaudi runs backward passes of its own (see unseen())
        self._passing = 0  # > 0 while a backward pass runs: one started inside it is part of it
        self.optimizers = weakref.WeakSet()  # every optimizer that has stepped
        self.timeline = Timeline()
        self.began = clock()  # the run so far is timed from here (the session's start)
        self._start_first_step()
        self.evaluation_passes = 0  # forward passes of a trained model without gradients
        self.evaluation_counted_until = None  # the step counting them stopped at (see EVALUATION_CHECKED_AT_STEP)
        self._outermost_calls = 0  # forward passes without gradients seen, of any model
        self._regions = Scope(guard)  # the region watch, closed on its own where it costs too much
        self._region = None  # the no_grad, inference_mode or set_grad_enabled(False) that turned gradients off
        self._calls_hook = None  # while in a region: the global hook that sees the next module call
        self._returned_hook = None  # while that call runs: a hook on that module, for its return
        self._guarded_call = guarded(guard, self._module_called)
        self._guarded_return = guarded(guard, self._module_returned)
        self._evaluated = weakref.WeakKeyDictionary()  # module -> passes not yet told trained or not
        self._trained = weakref.WeakKeyDictionary()  # module -> whether it is a model being trained
        # Telling accumulation apart in a loop without an optimizer: one parameter's gradient, as the
        # last pass left it (a weak reference and its version counter, bumped by zero_() and by
        # accumulating), and how many passes ran between clearings.
        self._sentinel = None
        self._grad_left = None
        self._since_cleared = 0
        self._cycles: list = []  # passes between clearings, before the counting mode is known
        self._per_step = 1  # backward passes per step once counted by backward passes

    @property
    def warmed_up(self) -> bool:
        """Whether the ``warmup_steps`` training steps (compiles, caches, allocator growth) are over:
        the timed window, the profiler's and the throughput meter's, starts at that boundary."""
        return self.steps >= self.options.warmup_steps

    @property
    def trained(self) -> bool:
        return self.backwards > 0 or self.optimizer_steps > 0

    def install(self) -> None:
        self._scope.add(self._routes.clear)
        self._scope.wrap(torch.autograd, "backward", self._backward)
        self._scope.wrap(torch.autograd, "grad", self._grad)
        self._scope.add(self._stop_counting_evaluation)
        for region in NO_GRAD_REGIONS:
            self._regions.wrap(region, "__enter__", self._region_entered)
            self._regions.wrap(region, "__exit__", self._region_left)
        self._scope.hook(register_optimizer_step_pre_hook, self._before_optimizer_step)
        self._scope.hook(register_optimizer_step_post_hook, self._after_optimizer_step)
        self._scope.wrap(dataloader._BaseDataLoaderIter, "__next__", self._next_batch)
        self._scope.wrap(dataloader.DataLoader, "__init__", self._new_loader)
        self._scope.wrap(dataloader.DataLoader, "__iter__", self._new_epoch)

    def uninstall(self) -> None:
        self._scope.close()

    def _new_loader(self, wrapped, instance, args, kwargs):
        # the class itself, not a subclass: a subclass's constructor arguments may mean something else
        if type(instance) is dataloader.DataLoader:
            args, kwargs = self.events.adjust(Event.LOADER_BUILT, instance, args, kwargs)
        return wrapped(*args, **kwargs)

    def _new_epoch(self, wrapped, instance, args, kwargs):
        self.events.emit(Event.EPOCH_START, instance)
        return wrapped(*args, **kwargs)

    def route_batches(self, iterator, source) -> None:
        """From now on ``iterator`` (a DataLoader iterator the script holds) yields what ``source``
        (another DataLoader iterator) yields; listeners still see ``iterator``. The route lives as
        long as ``iterator`` does, and ``source`` with it."""
        self._routes[iterator] = source

    def _next_batch(self, wrapped, instance, args, kwargs):
        source = self._routes.get(instance)
        if source is not None:  # the original __next__, run on the source: not seen twice here
            wrapped, args, kwargs = wrapped.instead(functools.partial(wrapped.wrapped.__func__, source)), (), {}
        if not self.backwards:
            self._start_first_step()
            self.timeline.first_step_from = "batch"
        if not self.events.listening(Event.BEFORE_BATCH, Event.BATCH_FETCHED):
            return wrapped(*args, **kwargs)
        self.events.emit(Event.BEFORE_BATCH, instance)
        start = clock()
        batch = wrapped(*args, **kwargs)  # StopIteration and the user's errors pass straight through
        self.events.emit(Event.BATCH_FETCHED, instance, batch, clock() - start)
        return batch

    @property
    def in_own_work(self) -> bool:
        """Inside :meth:`unseen`: what runs now is autogaudi's own (a shadow step, a forecast's fake
        step), and the objects it builds are no script's."""
        return self._unseen > 0

    @contextlib.contextmanager
    def unseen(self):
        """Backward passes autogaudi runs itself (mixed precision's shadow steps on a copy of the
        model, the memory forecast's fake steps) are not the user's: not counted, and no listener
        hears them (a loss scale would scale them)."""
        self._unseen += 1
        try:
            yield
        finally:
            self._unseen -= 1

    def _backward(self, wrapped, instance, args, kwargs):
        if self._unseen or self._passing:
            self.own_backwards += 1
            return wrapped(*args, **kwargs)
        tensors = args[0] if args else kwargs.get("tensors")
        cleared = self._gradients_cleared(tensors)
        self.events.emit(Event.BEFORE_BACKWARD, tensors)
        result = self._pass(wrapped, args, kwargs)
        self.events.emit(Event.AFTER_BACKWARD)
        self._passed(cleared)
        return result

    def _grad(self, wrapped, instance, args, kwargs):
        """``torch.autograd.grad``: counted like a backward pass, unheard by the listeners (they act
        on ``.grad``, which it leaves alone); each one starts afresh (nothing accumulates)."""
        if args[4] if len(args) > 4 else kwargs.get("create_graph", False):
            return wrapped(*args, **kwargs)
        if self._unseen or self._passing:
            self.own_backwards += 1
            return wrapped(*args, **kwargs)
        result = self._pass(wrapped, args, kwargs)
        self._passed(cleared=True)
        return result

    def _pass(self, wrapped, args, kwargs):
        self._passing += 1
        try:
            return wrapped(*args, **kwargs)
        finally:
            self._passing -= 1

    def _gradients_cleared(self, tensors) -> bool:
        """Whether the gradients were cleared (set to None, zeroed or replaced) since the last pass:
        where not, this pass accumulates into the last one's. Only asked while the loop may be one
        without an optimizer (an optimizer's steps count the steps otherwise)."""
        if self.counted_by == BY_OPTIMIZER:
            return True
        param = self._sentinel() if self._sentinel is not None else None
        if param is None:
            param = _a_parameter(tensors)
            self._sentinel = weakref.ref(param) if param is not None else None
            self._grad_left = None
        grad = param.grad if param is not None else None
        left = self._grad_left
        return grad is None or left is None or left[0]() is not grad or grad._version != left[1]

    def _passed(self, cleared: bool) -> None:
        self.backwards += 1
        if self._step_frames and self._inside_an_optimizer_step():
            self.backwards_in_optimizer_steps += 1
            return
        if self.counted_by == BY_OPTIMIZER:
            return
        param = self._sentinel() if self._sentinel is not None else None
        grad = param.grad if param is not None else None
        self._grad_left = (weakref.ref(grad), grad._version) if grad is not None else None
        if cleared and self._since_cleared:
            if self.counted_by is None:
                self._cycles.append(self._since_cleared)
            self._since_cleared = 0
        self._since_cleared += 1
        if self.counted_by is None:
            if self.backwards < NO_OPTIMIZER_AFTER or self.optimizer_steps:
                return
            self._count_by_backward()
        elif self._since_cleared % self._per_step == 0:
            self._end_step(None)

    def _count_by_backward(self) -> None:
        """No optimizer: from now on k backward passes make a step, k the passes between gradient
        clearings seen so far (1 where none were seen); the passes so far are counted now, as the
        steps they made, over the time they took."""
        self.counted_by = BY_BACKWARD
        self._per_step = max(1, round(statistics.median(self._cycles))) if self._cycles else 1
        done = len(self._cycles) + self._since_cleared // self._per_step
        self._since_cleared %= self._per_step
        if done:
            self._end_step(None, steps=done)

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        frame = sys._getframe(1)
        while frame.f_code.co_filename == guard.__file__:  # the guard's frames between torch and this hook
            frame = frame.f_back
        self._step_frames.append(frame)  # torch's step wrapper, which calls the hooks
        self.events.emit(Event.BEFORE_OPTIMIZER_STEP, optimizer, args, kwargs)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._step_frames:
            self._step_frames.pop()
        self.optimizer_steps += 1
        self.optimizers.add(optimizer)
        self.events.emit(Event.OPTIMIZER_STEP, optimizer)
        if self._paces(optimizer):
            self._end_step(optimizer)

    def _inside_an_optimizer_step(self) -> bool:
        """Whether an optimizer step is still running below this call. A step that raised never
        reached its post-hook: its frame is gone from the stack, and so is it from the list (a
        counter would have stayed up and excluded every later backward pass)."""
        running = set()
        frame = sys._getframe(1)
        while frame is not None:
            running.add(id(frame))
            frame = frame.f_back
        self._step_frames = [frame for frame in self._step_frames if id(frame) in running]
        return bool(self._step_frames)

    def _paces(self, optimizer) -> bool:
        pacer = self._pacer() if self._pacer is not None else None
        if pacer is optimizer:
            self._others_in_a_row = 0
            return True
        self._others_in_a_row += 1
        if pacer is None or self._others_in_a_row > REPACE_AFTER:
            self._pacer, self._others_in_a_row, self.counted_by = weakref.ref(optimizer), 0, BY_OPTIMIZER
            return True
        return False

    def _start_first_step(self) -> None:
        """The first step starts now (see the module's docstring): read on :func:`clock`, as every
        later boundary is, so that a test's clock times the first step too."""
        self._first_clock = clock()

    def _end_step(self, optimizer, steps: int = 1) -> None:
        """``steps`` training steps ended (more than one only when they are counted after the fact,
        each given an equal share of the time since the last boundary); listeners hear one."""
        now = clock()
        start = self.last_step_clock if self.last_step_clock is not None else self._first_clock
        for _ in range(steps):
            self.timeline.step((now - start) / steps)
        self.steps += steps
        self.last_step_clock = now
        if self._timed_from is None and self.warmed_up:
            self._timed_from = (self.steps, now)
        self._tell_evaluation_passes()
        if self.steps >= EVALUATION_CHECKED_AT_STEP > self.steps - steps and self._outermost_calls > self.steps:
            self._stop_counting_evaluation()
            self.evaluation_counted_until = self.steps
        self.events.emit(Event.TRAINING_STEP, optimizer)

    def _region_entered(self, wrapped, instance, args, kwargs):
        # set_grad_enabled(False) turns gradients off when made, before it is entered: its ``prev``
        # says what it found. A region inside gradients already off (an optimizer's step) is not one.
        enabled_before = instance.prev if isinstance(instance, torch.set_grad_enabled) else torch.is_grad_enabled()
        result = wrapped(*args, **kwargs)
        if self._region is None and enabled_before and not torch.is_grad_enabled() and not _compiling():
            self._region = instance
            self._watch_module_calls()
        return result

    def _region_left(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        if instance is self._region:
            self._region = None
            self._stop_watching_module_calls()
            if not self.backwards:  # an evaluation before training: the first step starts after it
                self._start_first_step()
            self._tell_evaluation_passes()
        return result

    # Inside a region without gradients one global pre-hook sees the next module call; it steps aside
    # for that call (a hook on that module alone tells when it returns), so the modules inside a pass
    # run on torch's fast path and only its outermost call costs anything.
    def _watch_module_calls(self) -> None:
        if self._calls_hook is None and self._returned_hook is None:
            self._calls_hook = module_hooks.register_forward_pre_hook(self._guarded_call)

    def _stop_counting_evaluation(self) -> None:
        self._regions.close()
        self._region = None
        self._stop_watching_module_calls()

    def _stop_watching_module_calls(self) -> None:
        for handle in (self._calls_hook, self._returned_hook):
            if handle is not None:
                handle.remove()
        self._calls_hook = self._returned_hook = None

    def _module_called(self, module, args):
        if _compiling() or _inside_a_module_call():  # a region opened inside a forward: no pass of its own
            return
        self._calls_hook.remove()
        self._calls_hook = None
        self._outermost_calls += 1
        self._returned_hook = module.register_forward_hook(self._guarded_return, always_call=True)
        if not self._unseen and not torch.is_grad_enabled():
            self._evaluated[module] = self._evaluated.get(module, 0) + 1

    def _module_returned(self, module, args, output):
        self._returned_hook.remove()
        self._returned_hook = None
        if self._region is not None:
            self._watch_module_calls()

    def _tell_evaluation_passes(self) -> None:
        """Count the forward passes without gradients of the models being trained, once it is known
        which those are (an optimizer stepped, or the loop is counted by its backward passes); a
        model that was not (a teacher, a frozen part) is forgotten. Each model is told apart once
        (a rollout under no_grad in every step must not walk the parameters every step). The
        timeline marks them."""
        if not self._evaluated or (not self.optimizers and self.counted_by != BY_BACKWARD):
            return
        unknown = [module for module in list(self._evaluated.keys()) if module not in self._trained]
        if unknown:
            trained = {
                id(p) for optimizer in self.optimizers for group in optimizer.param_groups for p in group["params"]
            }
            sentinel = self._sentinel() if self._sentinel is not None else None
            if sentinel is not None:
                trained.add(id(sentinel))
            for module in unknown:
                self._trained[module] = any(id(param) in trained for param in module.parameters())
        passes = sum(count for module, count in list(self._evaluated.items()) if self._trained.get(module))
        self._evaluated.clear()
        if passes:
            self.evaluation_passes += passes
            self.timeline.add_to_mark(self.steps, "steps", "evaluated", passes=passes)

    @property
    def timed(self):
        """(steps, seconds) since the end of warm-up, or None before two timed step boundaries or
        while the clock has not moved between them (a coarse clock, or a test's held still)."""
        if self._timed_from is None or self.steps <= self._timed_from[0]:
            return None
        first_step, first_clock = self._timed_from
        seconds = self.last_step_clock - first_clock
        return (self.steps - first_step, seconds) if seconds > 0 else None

    def figures(self) -> dict:
        """Counts and the steady-state rate (steps after warm-up, between step boundaries)."""
        figures = {
            "steps": self.steps,
            "steps_counted_by": self.counted_by,
            "backward_passes": self.backwards,
            "backward_passes_per_step": self._per_step if self.counted_by == BY_BACKWARD else None,
            "backward_passes_in_optimizer_steps": self.backwards_in_optimizer_steps,
            "own_backward_passes": self.own_backwards,
            "optimizer_steps": self.optimizer_steps,
            "evaluation_forward_passes": self.evaluation_passes,
            "evaluation_counted_until_step": self.evaluation_counted_until,
        }
        if self.timed:
            steps, seconds = self.timed
            figures["steps_per_s"] = round(steps / seconds, 3)
            figures["timed_steps"] = steps
        figures["warmup_steps"] = self.options.warmup_steps
        return figures


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


def _compiling() -> bool:
    """Inside torch.compile, tracing or compiling a frame: hooks are not added or removed there (the
    compiler guards on the global module hooks it saw, and its own code enters no_grad regions)."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and compiler.is_compiling():
        return True
    guards = sys.modules.get("torch._guards")
    return guards is not None and guards.TracingContext.try_get() is not None


def _a_parameter(tensors):
    """A tensor the pass accumulates a gradient into (a parameter), found from the loss's graph
    within ``LEAF_SEARCH`` nodes; None where there is none near."""
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tensors or ()
    nodes = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for _ in range(LEAF_SEARCH):
        if not nodes:
            return None
        node = nodes.pop(0)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf's gradient goes there
        if variable is not None:
            return variable
        nodes.extend(child for child, _ in node.next_functions if child is not None)
    return None
