r"""Where the training steps are: every backward pass and every optimizer step, seen once.

Several units need the same moments (HPU step marks, throughput, the step profiler), so the
session watches them once and emits them as :class:`~autogaudi.events.Event`\ s:
``torch.autograd.backward`` is wrapped (``loss.backward()`` and ``scaler.scale(loss).backward()``
both go through it), and optimizer steps come from torch's own ``register_optimizer_step_post_hook``,
which fires for every optimizer, including ``GradScaler.step`` and ``step(closure)``. Timing reads
the clock at step boundaries and adds no device synchronisation.

A *training step* is one iteration of the user's loop: a step of one optimizer, the pacer (the first
to step; a GAN's two optimizers or forward-forward's per-layer ones make one iteration one step; the
pacer passes to another optimizer that steps ``REPACE_AFTER`` times in a row without it). A loop that
updates its parameters by hand (no ``torch.optim`` step after ``NO_OPTIMIZER_AFTER`` backward passes)
has its steps counted by backward passes; an optimizer that steps later takes over the count.
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

from autogaudi import guard
from autogaudi.events import Event
from autogaudi.unit import Scope

# What the step watcher patches (dotted owner.attribute), besides torch's optimizer-step hooks.
TARGETS = (
    "torch.autograd.backward",
    "torch.utils.data.dataloader._BaseDataLoaderIter.__next__",
    "torch.utils.data.DataLoader.__init__",
    "torch.utils.data.DataLoader.__iter__",
)
NO_OPTIMIZER_AFTER = 16  # backward passes with no optimizer step before backward passes count as steps
REPACE_AFTER = 8  # steps of another optimizer in a row, the pacer silent, before it paces instead
BY_OPTIMIZER, BY_BACKWARD = "optimizer steps", "backward passes"
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
    """The clock batch waits are timed by (seconds), and the step profiler's and loader_workers'
    measurements with them; tests replace it to decide on given times (the ``step_clock`` fixture)."""
    return time.perf_counter()


class TrainingSteps:
    def __init__(self, backend, options, events, guard):
        self.backend = backend
        self.options = options
        self.events = events  # the session's Dispatcher: what this watcher sees, it emits there
        self.backwards = 0
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
        self.optimizers = weakref.WeakSet()  # every optimizer that has stepped

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
        if not self.events.listening(Event.BEFORE_BATCH, Event.BATCH_FETCHED):
            return wrapped(*args, **kwargs)
        self.events.emit(Event.BEFORE_BATCH, instance)
        start = clock()
        batch = wrapped(*args, **kwargs)  # StopIteration and the user's errors pass straight through
        self.events.emit(Event.BATCH_FETCHED, instance, batch, clock() - start)
        return batch

    @contextlib.contextmanager
    def unseen(self):
        """Backward passes autogaudi runs itself (mixed precision's shadow steps on a copy of the
        model) are not the user's: not counted, and no listener hears them (a loss scale would scale
        them)."""
        self._unseen += 1
        try:
            yield
        finally:
            self._unseen -= 1

    def _backward(self, wrapped, instance, args, kwargs):
        if self._unseen:
            return wrapped(*args, **kwargs)
        self.events.emit(Event.BEFORE_BACKWARD, args[0] if args else kwargs.get("tensors"))
        result = wrapped(*args, **kwargs)
        self.backwards += 1
        self.events.emit(Event.AFTER_BACKWARD)
        if self._step_frames and self._inside_an_optimizer_step():
            return result
        if self.counted_by is None and self.backwards >= NO_OPTIMIZER_AFTER and not self.optimizer_steps:
            self.counted_by = BY_BACKWARD
        if self.counted_by == BY_BACKWARD:
            self._end_step(None)
        return result

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

    def _end_step(self, optimizer) -> None:
        self.steps += 1
        now = time.perf_counter()
        self.last_step_clock = now
        if self._timed_from is None and self.warmed_up:
            self._timed_from = (self.steps, now)
        self.events.emit(Event.TRAINING_STEP, optimizer)

    @property
    def timed(self):
        """(steps, seconds) since the end of warm-up, or None before two timed step boundaries."""
        if self._timed_from is None or self.steps <= self._timed_from[0]:
            return None
        first_step, first_clock = self._timed_from
        return self.steps - first_step, self.last_step_clock - first_clock

    def figures(self) -> dict:
        """Counts and the steady-state rate (steps after warm-up, between step boundaries)."""
        figures = {
            "steps": self.steps,
            "steps_counted_by": self.counted_by,
            "backward_passes": self.backwards,
            "optimizer_steps": self.optimizer_steps,
        }
        if self.timed:
            steps, seconds = self.timed
            figures["steps_per_s"] = round(steps / seconds, 3)
            figures["timed_steps"] = steps
        figures["warmup_steps"] = self.options.warmup_steps
        return figures
