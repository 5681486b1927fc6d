r"""Where the training steps are: every backward pass and every optimizer step, seen once.

Several units need the same moments (HPU step marks, throughput, the step profiler), so the
session watches them once and emits them as :class:`~autogaudi.core.events.Event`\ s:
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

Forward passes without gradients (an evaluation loop, a rollout, generation) are no steps either,
and are counted apart (:mod:`autogaudi.watch.evaluation`). The rules that turn passes and optimizer steps
into training steps are :mod:`autogaudi.watch.step_count`'s, fed plain facts from here.

The first step is timed from the last batch fetched before the first backward pass (its forward,
lazy initialisation included), or from the session's start where no DataLoader feeds the loop;
``Timeline.first_step_from`` says which.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import time
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import dataloader

from autogaudi.core import guard
from autogaudi.core.events import Event
from autogaudi.core.unit import Scope
from autogaudi.measure import clock as measure_clock
from autogaudi.measure.timeline import Timeline
from autogaudi.watch.evaluation import EvaluationPasses
from autogaudi.watch.step_count import StepCount

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
    """The one clock (:func:`autogaudi.measure.clock.now`), read at every call: step boundaries, batch
    waits, the step profiler's, loader_workers', fused_optimizer's, the trials' and the doctor's
    measurements; a test replaces ``now`` to decide them all on given times."""
    return measure_clock.now()


class TrainingSteps:
    """The watch: patches turned into events, the step count fed, step boundaries timed."""

    def __init__(self, backend, options, events, guard):
        self.backend = backend
        self.options = options
        self.events = events  # the session's Dispatcher: what this watcher sees, it emits there
        self.count = StepCount()  # the rules that make passes and optimizer steps training steps
        self._step_frames: list = []  # steps under way: backward passes in step(closure) (LBFGS) are not steps
        self._routes = weakref.WeakKeyDictionary()  # DataLoader iterator -> the iterator yielding its batches
        self._scope = Scope(guard)  # its code inside the user's calls fails open through the session
        self._timed_from = None  # (step number, clock) once warm-up is over
        self.last_step_clock = None
        self._unseen = 0  # > 0 while autogaudi runs backward passes of its own (see unseen())
        self._passing = 0  # > 0 while a backward pass runs: one started inside it is part of it
        self.optimizers = weakref.WeakSet()  # every optimizer that has stepped
        self.timeline = Timeline()
        self.after_each_step = lambda: None  # the session's: once every listener heard the step
        self.began = clock()  # the run so far is timed from here (the session's start)
        self._start_first_step()
        self.evaluation = EvaluationPasses(self, guard)
        # Telling accumulation apart in a loop without an optimizer: one parameter's gradient, as the
        # last pass left it (a weak reference and its version counter, bumped by zero_() and by
        # accumulating).
        self._sentinel = None
        self._grad_left = None
        self.own_s = 0.0  # its bookkeeping's time inside the user's backward passes (the report's per-call work)

    steps = property(lambda self: self.count.steps, doc="training steps: iterations of the user's loop")
    backwards = property(lambda self: self.count.backwards, doc="the user's backward passes, all of them")
    optimizer_steps = property(lambda self: self.count.optimizer_steps)
    counted_by = property(lambda self: self.count.counted_by, doc="BY_OPTIMIZER or BY_BACKWARD, once known")

    @property
    def warmed_up(self) -> bool:
        """Whether the ``warmup_steps`` training steps (compiles, caches, allocator growth) are over:
        the timed window, the profiler's and the throughput meter's, starts at that boundary."""
        return self.steps >= self.options.warmup_steps

    @property
    def trained(self) -> bool:
        return self.backwards > 0 or self.optimizer_steps > 0

    def sentinel(self):
        """The parameter whose gradient tells a hand-written loop's accumulation apart, or None."""
        return self._sentinel() if self._sentinel is not None else None

    def install(self) -> None:
        self._scope.add(self._routes.clear)
        self.timeline.count_own_work(lambda: self.own_s)
        self._scope.wrap(torch.autograd, "backward", self._backward)
        self._scope.wrap(torch.autograd, "grad", self._grad)
        self._scope.add(self.evaluation.uninstall)
        self.evaluation.install()
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
            self.count.own_backward()
            return wrapped(*args, **kwargs)
        tensors = args[0] if args else kwargs.get("tensors")
        started = time.perf_counter()
        # a pass inside an optimizer step (LBFGS's closure) is no step of the loop: whether it
        # accumulates is not asked, and the loss's graph is not searched for a parameter
        inside = self._inside_an_optimizer_step()
        cleared = inside or self._gradients_cleared(tensors)
        self.own_s += time.perf_counter() - started
        self.events.emit(Event.BEFORE_BACKWARD, tensors)
        result = self._pass(wrapped, args, kwargs)
        self.events.emit(Event.AFTER_BACKWARD)
        self._passed(cleared, inside)
        return result

    def _grad(self, wrapped, instance, args, kwargs):
        """``torch.autograd.grad``: counted like a backward pass, unheard by the listeners (they act
        on ``.grad``, which it leaves alone); each one starts afresh (nothing accumulates)."""
        if args[4] if len(args) > 4 else kwargs.get("create_graph", False):
            return wrapped(*args, **kwargs)
        if self._unseen or self._passing:
            self.count.own_backward()
            return wrapped(*args, **kwargs)
        inside = self._inside_an_optimizer_step()
        result = self._pass(wrapped, args, kwargs)
        self._passed(True, inside)
        return result

    def _pass(self, wrapped, args, kwargs):
        self._passing += 1
        try:
            return wrapped(*args, **kwargs)
        finally:
            self._passing -= 1

    def _gradients_cleared(self, tensors) -> bool:
        """Whether the gradients were cleared (set to None, zeroed or replaced) since the last pass:
        where not, this pass accumulates into the last one's."""
        if not self.count.asks_clearing:
            return True
        param = self.sentinel()
        if param is None:
            param = _a_parameter(tensors)
            self._sentinel = weakref.ref(param) if param is not None else None
            self._grad_left = None
        grad = param.grad if param is not None else None
        left = self._grad_left
        return grad is None or left is None or left[0]() is not grad or grad._version != left[1]

    def _passed(self, cleared: bool, inside: bool) -> None:
        started = time.perf_counter()
        ended = self.count.backward(cleared, in_optimizer_step=inside)
        if not inside and self.count.asks_clearing:
            grad = getattr(self.sentinel(), "grad", None)
            self._grad_left = (weakref.ref(grad), grad._version) if grad is not None else None
        self.own_s += time.perf_counter() - started
        if ended:
            self._steps_ended(None, ended)

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        frame = sys._getframe(1)
        while frame.f_code.co_filename == guard.__file__:  # the guard's frames between torch and this hook
            frame = frame.f_back
        self._step_frames.append(frame)  # torch's step wrapper, which calls the hooks
        self.events.emit(Event.BEFORE_OPTIMIZER_STEP, optimizer, args, kwargs)

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._step_frames:
            self._step_frames.pop()
        self.count.optimizer_stepped()
        self.optimizers.add(optimizer)
        self.events.emit(Event.OPTIMIZER_STEP, optimizer)
        ended = self.count.paced_by(optimizer)
        if ended:
            self._steps_ended(optimizer, ended)

    def _inside_an_optimizer_step(self) -> bool:
        """Whether an optimizer step is still running below this call. A step that raised never
        reached its post-hook: its frame is gone from the stack, and so is it from the list (a
        counter would have stayed up and excluded every later backward pass). No step under way: the
        stack is not walked (every backward pass asks)."""
        if not self._step_frames:
            return False
        running = set()
        frame = sys._getframe(1)
        while frame is not None:
            running.add(id(frame))
            frame = frame.f_back
        self._step_frames = [frame for frame in self._step_frames if id(frame) in running]
        return bool(self._step_frames)

    def _start_first_step(self) -> None:
        """The first step starts now (see the module's docstring): read on :func:`clock`, as every
        later boundary is, so that a test's clock times the first step too."""
        self._first_clock = clock()

    def region_left(self) -> None:
        """A region without gradients ended: one before training (an evaluation first) is not the
        first step's time, which starts after it."""
        if not self.backwards:
            self._start_first_step()

    def _steps_ended(self, optimizer, steps: int) -> None:
        """``steps`` training steps ended (more than one only when they are counted after the fact,
        each given an equal share of the time since the last boundary); listeners hear one."""
        now = clock()
        start = self.last_step_clock if self.last_step_clock is not None else self._first_clock
        for _ in range(steps):
            self.timeline.step((now - start) / steps)
        self.last_step_clock = now
        if self._timed_from is None and self.warmed_up:
            self._timed_from = (self.steps, now)
        self.evaluation.steps_ended(steps, self.steps)
        self.events.emit(Event.TRAINING_STEP, optimizer)
        self.after_each_step()

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
            **self.count.figures(),
            "evaluation_forward_passes": self.evaluation.passes,
            "evaluation_counted_until_step": self.evaluation.counted_until,
        }
        if self.timed:
            steps, seconds = self.timed
            figures["steps_per_s"] = round(steps / seconds, 3)
            figures["timed_steps"] = steps
        figures["warmup_steps"] = self.options.warmup_steps
        return figures


def _a_parameter(tensors):
    """A tensor the pass accumulates a gradient into (a parameter), found from the loss's graph
    within ``LEAF_SEARCH`` nodes; None where there is none near. Depth first: a parameter is a few
    nodes below each layer's output, while a graph that joins many outputs (a ``cat`` of a thousand
    time steps) would hold a breadth-first search in its first level."""
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tensors or ()
    nodes = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    for _ in range(LEAF_SEARCH):
        if not nodes:
            return None
        node = nodes.pop()
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf's gradient goes there
        if variable is not None:
            return variable
        nodes.extend(child for child, _ in reversed(node.next_functions) if child is not None)
    return None
