"""The moments of a training run that units act on, and one dispatcher that hands them out.

Why one: the session's step watcher (``steps.py``) sees each moment once — a wrapped
``torch.autograd.backward``, torch's optimizer-step hooks, DataLoader's constructor, ``__iter__``
and ``__next__`` — and every unit, the profiler and the trial runner listen through :meth:`on`,
which returns a handle that removes exactly that listener (torch's ``RemovableHandle`` is the
model). A listener that raises fails only its owner: the owner is reverted and the run goes on.
"""

from __future__ import annotations

import enum

from autogaudi.guard import run_guarded


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


class _Listener:
    __slots__ = ("owner", "fn")

    def __init__(self, owner, fn):
        self.owner = owner
        self.fn = fn


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

    def on(self, event: Event, owner, fn) -> Handle:
        """Call ``fn`` at every ``event`` through the core's guard (:mod:`autogaudi.guard`: a listener
        that raises switches ``owner`` off); listeners run in the order they were added."""
        listener = _Listener(owner, fn)
        self._listeners[event].append(listener)
        return Handle(self._listeners[event], listener)

    def listening(self, *events: Event) -> bool:
        return any(self._listeners[event] for event in events)

    def emit(self, event: Event, *args) -> None:
        for listener in tuple(self._listeners[event]):
            run_guarded(listener.owner, listener.fn, *args)

    def adjust(self, event: Event, subject, args: tuple, kwargs: dict) -> tuple:
        """Hand a constructor's ``(args, kwargs)`` through the listeners in turn: each may return
        new ones (or None to leave them), and sees what the one before it returned."""
        for listener in tuple(self._listeners[event]):
            adjusted = run_guarded(listener.owner, listener.fn, subject, args, kwargs)
            if adjusted is not None:
                args, kwargs = adjusted
        return args, kwargs

    def forget(self, owner) -> None:
        """Remove every listener of ``owner`` (the session does this when it reverts a unit)."""
        for listeners in self._listeners.values():
            listeners[:] = [listener for listener in listeners if listener.owner is not owner]
