"""The moments of a training run that units act on, and one dispatcher that hands them out.

Why one: the session's step watcher (``steps.py``) sees each moment once — a wrapped
``torch.autograd.backward``, torch's optimizer-step hooks, DataLoader's constructor, ``__iter__``
and ``__next__`` — and every unit, the profiler and the trial runner listen through :meth:`on`,
which returns a handle that removes exactly that listener (torch's ``RemovableHandle`` is the
model). A listener that raises fails only its owner: the owner is reverted and the run goes on.
Listeners run in their owners' start order (:meth:`Dispatcher.rank`), whenever each was added: a
unit that listens only once the step is profiled (fp16's unscaling after a backward) still runs
before a unit that started later (fast_ddp's all-reduce of the same gradients).
"""

from __future__ import annotations

import bisect
import enum
import math

from autogaudi.core.guard import run_guarded


class Event(enum.Enum):
    """Each moment, with what its listeners are called with."""

    LOADER_BUILT = "loader built"  # (loader, args, kwargs) -> (args, kwargs) or None; see Dispatcher.adjust
    EPOCH_START = "epoch start"  # (loader): its iterator for a new epoch is about to be created
    BEFORE_BATCH = "before batch"  # (iterator): a DataLoader iterator is about to fetch a batch
    BATCH_FETCHED = "batch fetched"  # (iterator, batch, seconds waited)
    BEFORE_BACKWARD = "before backward"  # (the tensors backpropagated: the loss, usually)
    AFTER_BACKWARD = "after backward"  # ()
    BEFORE_OPTIMIZER_STEP = "before optimizer step"  # (optimizer, args, kwargs): args start with the optimizer
    OPTIMIZER_STEP = "optimizer step"  # (optimizer): after every step of every optimizer
    TRAINING_STEP = "training step"  # (pacing optimizer, or None): one iteration of the loop ended
    STEP_PROFILED = "step profiled"  # (StepProfile): the step was classified, once per run
    # (model, StepMemory): a training step of the model was measured (the first, the second, each after a
    # change), its forecast of the steps after in StepMemory.forecast; or the first will not be (no forecast)
    MEMORY_FORECAST = "memory forecast"


class _Listener:
    __slots__ = ("owner", "fn", "rank")

    def __init__(self, owner, fn, rank):
        self.owner = owner
        self.fn = fn
        self.rank = rank


class Handle:
    """Removes one listener; removing twice is harmless."""

    def __init__(self, listeners: list, listener: _Listener):
        self._listeners = listeners
        self._listener = listener

    def remove(self) -> None:
        self._listeners[:] = [listener for listener in self._listeners if listener is not self._listener]


class Dispatcher:
    def __init__(self):
        self._listeners = {event: [] for event in Event}
        self._ranks: dict = {}  # id(owner) -> its place in the start order

    def rank(self, owner, place: int) -> None:
        """``owner`` starts ``place``-th: its listeners run after those of owners ranked before it,
        and before those ranked after it, whenever either was added. Owners never ranked come last."""
        self._ranks[id(owner)] = place

    def on(self, event: Event, owner, fn) -> Handle:
        """Call ``fn`` at every ``event`` through the core's guard (:mod:`autogaudi.core.guard`: a listener
        that raises switches ``owner`` off); listeners run by their owners' rank, and those of one
        rank in the order they were added."""
        listener = _Listener(owner, fn, self._ranks.get(id(owner), math.inf))
        listeners = self._listeners[event]
        listeners.insert(bisect.bisect_right([other.rank for other in listeners], listener.rank), listener)
        return Handle(listeners, listener)

    def listening(self, *events: Event) -> bool:
        return any(self._listeners[event] for event in events)

    def emit(self, event: Event, *args) -> None:
        for listener in tuple(self._listeners[event]):
            run_guarded(listener.owner, listener.fn, *args)

    def adjust(self, event: Event, subject, args: tuple, kwargs: dict) -> tuple:
        """Hand a constructor's ``(args, kwargs)`` through the listeners in turn: each may return
        new ones (or None to leave them), and sees what the one before it returned."""
        return _adjusted(tuple(self._listeners[event]), subject, args, kwargs)

    def hand_to(self, owner, event: Event, *args):
        """The event under way, to ``owner``'s listeners only: an owner that started inside its
        emission (a unit loaded at its first event) hears it as if it had been listening. For
        ``LOADER_BUILT``, what :meth:`adjust` takes; else None."""
        listeners = [listener for listener in self._listeners[event] if listener.owner is owner]
        if event is Event.LOADER_BUILT:
            return _adjusted(listeners, *args)
        for listener in listeners:
            run_guarded(listener.owner, listener.fn, *args)
        return None

    def forget(self, owner) -> None:
        """Remove every listener of ``owner`` (the session does this when it reverts a unit)."""
        for listeners in self._listeners.values():
            listeners[:] = [listener for listener in listeners if listener.owner is not owner]


def _adjusted(listeners, subject, args: tuple, kwargs: dict) -> tuple:
    for listener in listeners:
        adjusted = run_guarded(listener.owner, listener.fn, subject, args, kwargs)
        if adjusted is not None:
            args, kwargs = adjusted
    return args, kwargs
