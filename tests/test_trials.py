"""The trial engine on fakes whose speeds are known: it keeps the faster, measures the one-off cost
apart, runs every step exactly once, and leaves the candidate in the state it decided."""

import time

import pytest

from autogaudi import trials


class FakeSteps:
    """The session's step hub, reduced to what the runner uses."""

    def __init__(self):
        self.listeners = []

    def after_step(self, _unit, listener):
        self.listeners.append(listener)

    def forget_listener(self, _unit, listener):
        self.listeners.remove(listener)


def run_trial(on_seconds, off_seconds, one_off=0.0):
    steps, state, decisions, ran = FakeSteps(), {"on": False, "switches": 0}, [], []

    def switch(on):
        state["switches"] += 1
        state["on"] = on

    runner = trials.TrialRunner(steps)
    runner.submit(trials.Trial(object(), "fake", switch, lambda keep, record: decisions.append((keep, record))))
    compiled = False
    while steps.listeners:  # the user's loop: one real step, then the optimizer-step boundary
        if state["on"] and not compiled:
            time.sleep(one_off)
            compiled = True
        time.sleep(on_seconds if state["on"] else off_seconds)
        ran.append(state["on"])
        for listener in list(steps.listeners):
            listener(None)
    return state, decisions, ran, runner


def test_keeps_the_candidate_that_is_faster():
    state, decisions, ran, runner = run_trial(on_seconds=0.002, off_seconds=0.006, one_off=0.05)
    ((keep, record),) = decisions
    assert keep and state["on"] and record["decision"] == "kept"
    assert 2.0 < record["speedup"] < 4.5
    assert record["one_off_s"] == pytest.approx(0.05, abs=0.03)
    assert record["pays_back_after_steps"] > 0
    assert len(ran) == record["steps"] == trials.WARMUP + trials.ROUNDS * 4 * trials.BLOCK
    assert ran.count(False) == ran.count(True) - trials.WARMUP  # both arms measured equally
    assert runner.records == [record]


def test_reverts_a_candidate_that_is_slower():
    state, decisions, _, _ = run_trial(on_seconds=0.006, off_seconds=0.002)
    ((keep, record),) = decisions
    assert not keep and not state["on"] and record["decision"] == "rejected"
    assert record["speedup"] < 0.6


def test_a_tie_within_the_margin_is_not_kept():
    _, decisions, _, _ = run_trial(on_seconds=0.004, off_seconds=0.004)
    assert decisions[0][0] is False


def test_trials_run_one_after_another():
    steps, order = FakeSteps(), []
    runner = trials.TrialRunner(steps)
    for name in ("first", "second"):
        runner.submit(
            trials.Trial(object(), name, lambda on, name=name: order.append((name, on)), lambda keep, record: None)
        )
    while steps.listeners:
        for listener in list(steps.listeners):
            listener(None)
    firsts = [i for i, (name, _) in enumerate(order) if name == "first"]
    seconds = [i for i, (name, _) in enumerate(order) if name == "second"]
    assert max(firsts) < min(seconds)
    assert [record["candidate"] for record in runner.records] == ["first", "second"]
