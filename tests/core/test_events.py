"""The dispatcher: listeners in order, removal by handle (exactly the one registered), a raising
listener failing only its owner, constructor arguments adjusted in turn, and forget(owner)."""

from autogaudi.core.events import Dispatcher, Event
from tests.helpers import GuardOwner


def test_listeners_run_in_order_and_a_handle_removes_exactly_its_own():
    events, first, second, heard = Dispatcher(), GuardOwner(), GuardOwner(), []
    listener = heard.append  # the same function under two owners
    handle = events.on(Event.TRAINING_STEP, first, listener)
    events.on(Event.TRAINING_STEP, second, listener)
    events.on(Event.TRAINING_STEP, second, lambda optimizer: heard.append(("last", optimizer)))
    events.emit(Event.TRAINING_STEP, 1)
    assert heard == [1, 1, ("last", 1)]
    handle.remove()
    handle.remove()  # twice: harmless
    heard.clear()
    events.emit(Event.TRAINING_STEP, 2)
    assert heard == [2, ("last", 2)] and not events.listening(Event.BATCH_FETCHED)


def test_a_listener_that_raises_fails_its_owner_only():
    events, broken, fine, heard = Dispatcher(), GuardOwner(), GuardOwner(), []

    def breaks(_iterator, _batch, _waited):
        raise RuntimeError("unit bug")

    events.on(Event.BATCH_FETCHED, broken, breaks)
    events.on(Event.BATCH_FETCHED, fine, lambda *args: heard.append(args))
    events.emit(Event.BATCH_FETCHED, "iterator", "batch", 0.5)
    assert broken.failures == [repr(RuntimeError("unit bug"))] and not fine.failures
    assert heard == [("iterator", "batch", 0.5)]


def test_loader_arguments_are_adjusted_in_turn_and_none_leaves_them():
    events, owner = Dispatcher(), GuardOwner()
    events.on(Event.LOADER_BUILT, owner, lambda loader, args, kwargs: (args, {**kwargs, "pin_memory": True}))
    events.on(Event.LOADER_BUILT, owner, lambda loader, args, kwargs: None)
    events.on(Event.LOADER_BUILT, owner, lambda loader, args, kwargs: (args + ("seen",), kwargs))
    assert events.adjust(Event.LOADER_BUILT, "loader", ("dataset",), {}) == (("dataset", "seen"), {"pin_memory": True})


def test_forget_removes_every_listener_of_an_owner():
    events, gone, kept = Dispatcher(), GuardOwner(), GuardOwner()
    for event in (Event.BEFORE_BACKWARD, Event.AFTER_BACKWARD, Event.OPTIMIZER_STEP):
        events.on(event, gone, lambda *args: None)
    events.on(Event.AFTER_BACKWARD, kept, lambda: None)
    events.forget(gone)
    assert not events.listening(Event.BEFORE_BACKWARD, Event.OPTIMIZER_STEP)
    assert events.listening(Event.AFTER_BACKWARD)


def test_a_listener_added_late_runs_before_those_of_owners_that_started_later():
    events, early, later, unranked, heard = Dispatcher(), GuardOwner(), GuardOwner(), GuardOwner(), []
    events.rank(early, 0)
    events.rank(later, 1)
    events.on(Event.AFTER_BACKWARD, unranked, lambda: heard.append("unranked"))
    events.on(Event.AFTER_BACKWARD, later, lambda: heard.append("all-reduce"))  # added when it started
    events.on(Event.AFTER_BACKWARD, early, lambda: heard.append("unscale"))  # added once the step is profiled
    events.on(Event.AFTER_BACKWARD, early, lambda: heard.append("watch"))
    events.emit(Event.AFTER_BACKWARD)
    assert heard == ["unscale", "watch", "all-reduce", "unranked"]


def test_an_event_handed_to_one_owner_reaches_its_listeners_only_and_adjusts_in_turn():
    """What a unit loaded inside an event's emission hears of that event: only its own listeners,
    and for a loader's construction the arguments its listeners return."""
    events, started_late, others, heard = Dispatcher(), GuardOwner(), GuardOwner(), []
    events.on(Event.BATCH_FETCHED, others, lambda *args: heard.append(("others", args)))
    events.on(Event.BATCH_FETCHED, started_late, lambda *args: heard.append(("late", args)))
    assert events.hand_to(started_late, Event.BATCH_FETCHED, "iterator", "batch", 0.5) is None
    assert heard == [("late", ("iterator", "batch", 0.5))]
    events.on(Event.LOADER_BUILT, others, lambda loader, args, kwargs: (args, {**kwargs, "others": True}))
    events.on(Event.LOADER_BUILT, started_late, lambda loader, args, kwargs: (args, {**kwargs, "workers": 2}))
    events.on(Event.LOADER_BUILT, started_late, lambda loader, args, kwargs: (args + ("seen",), kwargs))
    assert events.hand_to(started_late, Event.LOADER_BUILT, "loader", (), {}) == (("seen",), {"workers": 2})
