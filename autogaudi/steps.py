"""Where the training steps are: every backward pass and every optimizer step, seen once.

Several units need the same moments (HPU step marks, throughput, the step profiler), so the
session watches them once and hands them out: ``torch.autograd.backward`` is wrapped (``loss.backward()``
and ``scaler.scale(loss).backward()`` both go through it), and optimizer steps come from torch's
own ``register_optimizer_step_post_hook``, which fires for every optimizer, including
``GradScaler.step`` and ``step(closure)``. Listeners are units; a listener that raises fails only
its own unit. Timing reads the clock at step boundaries and adds no device synchronisation.

A *training step* is one iteration of the user's loop: a step of one optimizer, the pacer (the first
to step; a GAN's two optimizers or forward-forward's per-layer ones make one iteration one step; the
pacer passes to another optimizer that steps ``REPACE_AFTER`` times in a row without it). A loop that
updates its parameters by hand (no ``torch.optim`` step after ``NO_OPTIMIZER_AFTER`` backward passes)
has its steps counted by backward passes; an optimizer that steps later takes over the count.
"""

from __future__ import annotations

import functools
import sys
import time
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import dataloader

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


class TrainingSteps:
    def __init__(self, backend, options):
        self.backend = backend
        self.options = options
        self.backwards = 0
        self.optimizer_steps = 0
        self.steps = 0  # training steps: iterations of the user's loop
        self.counted_by = None  # BY_OPTIMIZER or BY_BACKWARD once the first step is seen
        self._pacer = None  # weak reference to the optimizer whose steps are the training steps
        self._others_in_a_row = 0
        self._step_frames: list = []  # steps under way: backward passes in step(closure) (LBFGS) are not steps
        self._loader_adjusters: list = []
        self._epoch_listeners: list = []
        self._before_batch_listeners: list = []
        self._after_batch_listeners: list = []
        self._before_backward_listeners: list = []
        self._after_backward_listeners: list = []
        self._after_optimizer_listeners: list = []
        self._after_step_listeners: list = []
        self._routes = weakref.WeakKeyDictionary()  # DataLoader iterator -> the iterator yielding its batches
        self._scope = Scope()
        self._timed_from = None  # (step number, clock) once warm-up is over
        self.last_step_clock = None

    @property
    def trained(self) -> bool:
        return self.backwards > 0 or self.optimizer_steps > 0

    def install(self) -> None:
        self._scope.add(self._routes.clear)
        self._scope.wrap(torch.autograd, "backward", self._backward)
        self._scope.add(register_optimizer_step_pre_hook(self._before_optimizer_step).remove)
        self._scope.add(register_optimizer_step_post_hook(self._after_optimizer_step).remove)
        self._scope.wrap(dataloader._BaseDataLoaderIter, "__next__", self._next_batch)
        self._scope.wrap(dataloader.DataLoader, "__init__", self._new_loader)
        self._scope.wrap(dataloader.DataLoader, "__iter__", self._new_epoch)

    def uninstall(self) -> None:
        self._scope.close()

    def adjust_loader(self, unit, adjuster) -> None:
        """``adjuster(loader, args, kwargs) -> (args, kwargs) or None`` before a ``DataLoader`` (the
        class itself, not a subclass: its constructor may mean something else) is built; adjusters
        run in unit order, each seeing the previous one's arguments; None leaves them as they are."""
        self._loader_adjusters.append((unit, adjuster))

    def before_epoch(self, unit, listener) -> None:
        """``listener(loader)`` when a DataLoader is about to create the iterator of a new epoch."""
        self._epoch_listeners.append((unit, listener))

    def before_batch(self, unit, listener) -> None:
        """``listener(iterator)`` before a DataLoader iterator fetches a batch."""
        self._before_batch_listeners.append((unit, listener))

    def after_batch(self, unit, listener) -> None:
        """``listener(iterator, batch, waited_seconds)`` once a batch has been fetched."""
        self._after_batch_listeners.append((unit, listener))

    def before_backward(self, unit, listener) -> None:
        self._before_backward_listeners.append((unit, listener))

    def after_backward(self, unit, listener) -> None:
        self._after_backward_listeners.append((unit, listener))

    def after_optimizer_step(self, unit, listener) -> None:
        """``listener(optimizer)`` after every step of every optimizer."""
        self._after_optimizer_listeners.append((unit, listener))

    def after_step(self, unit, listener) -> None:
        """``listener(optimizer or None)`` at the end of each training step (see the module's docstring):
        the pacing optimizer, or None where steps are counted by backward passes."""
        self._after_step_listeners.append((unit, listener))

    def forget(self, unit) -> None:
        """Drop a unit's listeners (it was reverted)."""
        for listeners in (
            self._loader_adjusters,
            self._epoch_listeners,
            self._before_batch_listeners,
            self._after_batch_listeners,
            self._before_backward_listeners,
            self._after_backward_listeners,
            self._after_optimizer_listeners,
            self._after_step_listeners,
        ):
            listeners[:] = [(owner, fn) for owner, fn in listeners if owner is not unit]

    def forget_listener(self, unit, listener) -> None:
        """Drop one training-step listener of a unit (e.g. a finished trial's)."""
        self._after_step_listeners[:] = [
            (owner, fn) for owner, fn in self._after_step_listeners if not (owner is unit and fn == listener)
        ]

    def _new_loader(self, wrapped, instance, args, kwargs):
        if type(instance) is dataloader.DataLoader:
            for unit, adjuster in tuple(self._loader_adjusters):
                adjusted = None
                with unit.fail_open():
                    adjusted = adjuster(instance, args, kwargs)
                if adjusted is not None:
                    args, kwargs = adjusted
        return wrapped(*args, **kwargs)

    def _new_epoch(self, wrapped, instance, args, kwargs):
        self._notify(self._epoch_listeners, instance)
        return wrapped(*args, **kwargs)

    def route_batches(self, iterator, source) -> None:
        """From now on ``iterator`` (a DataLoader iterator the script holds) yields what ``source``
        (another DataLoader iterator) yields; listeners still see ``iterator``. The route lives as
        long as ``iterator`` does, and ``source`` with it."""
        self._routes[iterator] = source

    def _next_batch(self, wrapped, instance, args, kwargs):
        source = self._routes.get(instance)
        if source is not None:  # the original __next__, run on the source: not seen twice here
            wrapped, args, kwargs = functools.partial(wrapped.__func__, source), (), {}
        if not (self._before_batch_listeners or self._after_batch_listeners):
            return wrapped(*args, **kwargs)
        self._notify(self._before_batch_listeners, instance)
        start = time.perf_counter()
        batch = wrapped(*args, **kwargs)  # StopIteration and the user's errors pass straight through
        self._notify(self._after_batch_listeners, instance, batch, time.perf_counter() - start)
        return batch

    def _backward(self, wrapped, instance, args, kwargs):
        self._notify(self._before_backward_listeners)
        result = wrapped(*args, **kwargs)
        self.backwards += 1
        self._notify(self._after_backward_listeners)
        if self._step_frames and self._inside_an_optimizer_step():
            return result
        if self.counted_by is None and self.backwards >= NO_OPTIMIZER_AFTER and not self.optimizer_steps:
            self.counted_by = BY_BACKWARD
        if self.counted_by == BY_BACKWARD:
            self._end_step(None)
        return result

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._step_frames.append(sys._getframe(1))  # torch's step wrapper, which calls the hooks

    def _after_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._step_frames:
            self._step_frames.pop()
        self.optimizer_steps += 1
        self._notify(self._after_optimizer_listeners, optimizer)
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
        if self.steps == self.options.warmup_steps + 1:
            self._timed_from = (self.steps, now)
        self._notify(self._after_step_listeners, optimizer)

    def _notify(self, listeners, *args) -> None:
        for unit, listener in tuple(listeners):
            with unit.fail_open():
                listener(*args)

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
