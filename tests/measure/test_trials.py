"""The trial engine on fakes whose speeds are known: it keeps the faster, measures the one-off cost
apart, runs every step exactly once, and leaves the candidate in the state it decided."""

import pytest

from autogaudi.core.events import Dispatcher, Event
from autogaudi.measure import machine_load, trials
from autogaudi.measure.timeline import Timeline


class FakeSteps:
    """The session's step watcher, reduced to its count, the training-step event and its timeline."""

    def __init__(self):
        self.events = Dispatcher()
        self.steps = 0
        self.timeline = Timeline()

    @property
    def listening(self) -> bool:
        return self.events.listening(Event.TRAINING_STEP)

    def end_step(self) -> None:
        self.steps += 1
        self.events.emit(Event.TRAINING_STEP, None)


class FakeUnit:
    """A trial's candidate unit as the guard sees it: in force, and an error of its lets out."""

    in_force = True

    @staticmethod
    def failed_at_run_time(error):
        raise error


def run_trial(clock, on_seconds, off_seconds, one_off=0.0, off_after_on=None, jitter=0.0, **trial):
    """The user's loop around one trial; ``off_after_on``: what an "off" step takes once the
    candidate has been on (an arm slowed by what the other left behind); ``jitter``: what steps
    add and take in turn (+, -, 0), each arm alike."""
    steps, state, decisions, ran = FakeSteps(), {"on": False, "switches": 0, "was_on": False}, [], []

    def switch(on):
        state["switches"] += 1
        state["on"] = on
        state["was_on"] |= on

    runner = trials.TrialRunner(steps, steps.events)
    runner.submit(
        trials.Trial(FakeUnit(), "fake", switch, lambda keep, record: decisions.append((keep, record)), **trial)
    )
    compiled = False
    while steps.listening:  # the user's loop: one real step, then the optimizer-step boundary
        if state["on"] and not compiled:
            clock.advance(one_off)
            compiled = True
        stray = (jitter, -jitter, 0.0)[len(ran) % 3]
        if state["on"]:
            clock.advance(on_seconds + stray)
        else:
            clock.advance((off_after_on if state["was_on"] and off_after_on else off_seconds) + stray)
        ran.append(state["on"])
        steps.end_step()
    return state, decisions, ran, runner


def test_keeps_the_candidate_that_is_faster(step_clock):
    state, decisions, ran, runner = run_trial(step_clock, on_seconds=0.002, off_seconds=0.006, one_off=0.05)
    ((keep, record),) = decisions
    assert keep and state["on"] and record["decision"] == "kept"
    assert 2.0 < record["speedup"] < 4.5
    assert record["one_off_s"] == pytest.approx(0.05, abs=0.03)
    assert record["pays_back_after_steps"] > 0
    assert len(ran) == record["steps"] == trials.BLOCK + trials.WARMUP + trials.ROUNDS * 4 * trials.BLOCK
    # the arms the report's chart shades: every step of the trial, in the order they ran
    assert sum(count for _arm, count in record["arms"]) == record["steps"]
    assert record["arms"][:3] == [["without", trials.BLOCK], ["warm-up", trials.WARMUP], ["with", trials.BLOCK]]
    assert ran[: trials.BLOCK] == [False] * trials.BLOCK  # timed before the candidate is ever on
    assert ran.count(False) - trials.BLOCK == ran.count(True) - trials.WARMUP  # both arms measured equally
    assert runner.records == [record]


def test_the_one_off_includes_what_setting_the_candidate_up_took(step_clock):
    _, decisions, _, _ = run_trial(step_clock, on_seconds=0.002, off_seconds=0.006, one_off=0.05, set_up_s=1.5)
    ((_, record),) = decisions
    assert record["set_up_s"] == 1.5
    assert record["one_off_s"] == pytest.approx(1.55, abs=0.03)


def test_an_off_arm_slowed_by_the_candidate_is_read_from_the_steps_before_the_trial(step_clock):
    # Plain steps take 4 ms; the candidate takes 4.4 ms and leaves "off" steps at 8 ms after it has
    # been on: against the interleaved arm it would read 1.8x, against the plain steps it is slower.
    # (10% apart, on the test's clock.)
    _, decisions, _, _ = run_trial(step_clock, on_seconds=0.0044, off_seconds=0.004, off_after_on=0.008)
    ((keep, record),) = decisions
    assert record["ms_per_step_without_interleaved"] > 1.5 * record["ms_per_step_before_trial"]
    assert record["ms_per_step_without"] == record["ms_per_step_before_trial"]
    assert not keep and record["speedup"] < 1.0


def test_cancelling_a_waiting_trial_leaves_no_listener_and_reports_idle():
    steps = FakeSteps()
    unit = FakeUnit()
    runner = trials.TrialRunner(steps, steps.events)
    runner.windows.take(FakeUnit())  # another measurement holds the steps: the trial waits for them
    runner.submit(trials.Trial(unit, "later", lambda on: None, lambda keep, record: None))
    assert steps.listening and not runner.idle
    runner.cancel(unit)
    assert not steps.listening and runner.idle


def test_reverts_a_candidate_that_is_slower(step_clock):
    state, decisions, _, _ = run_trial(step_clock, on_seconds=0.006, off_seconds=0.002)
    ((keep, record),) = decisions
    assert not keep and not state["on"] and record["decision"] == "rejected"
    assert record["speedup"] < 0.6


def test_a_tie_within_the_margin_is_not_kept(step_clock):
    _, decisions, _, _ = run_trial(step_clock, on_seconds=0.004, off_seconds=0.004)
    assert decisions[0][0] is False


def test_trials_run_one_after_another(step_clock):
    steps, order = FakeSteps(), []
    runner = trials.TrialRunner(steps, steps.events)
    for name in ("first", "second"):
        runner.submit(
            trials.Trial(FakeUnit(), name, lambda on, name=name: order.append((name, on)), lambda keep, record: None)
        )
    while steps.listening:
        step_clock.advance(0.001)
        steps.end_step()
    firsts = [i for i, (name, _) in enumerate(order) if name == "first"]
    seconds = [i for i, (name, _) in enumerate(order) if name == "second"]
    assert max(firsts) < min(seconds)
    assert [record["candidate"] for record in runner.records] == ["first", "second"]


def run_check(clock, step_seconds, expected_s, load_then=1.0, jitter=()):
    """A remembered keep followed at a known step time, checked against ``expected_s``; ``jitter``:
    what each steady step adds to ``step_seconds`` in turn."""
    steps, decisions, ran = FakeSteps(), [], 0
    runner = trials.TrialRunner(steps, steps.events)
    runner.submit(
        trials.Check(
            FakeUnit(), "fake", expected_s, lambda ok, record: decisions.append((ok, record)), 2, load_then=load_then
        )
    )
    while steps.listening:
        steady = ran - 2
        extra = jitter[steady % len(jitter)] if jitter and steady >= 0 else 0.0
        clock.advance(0.05 if ran < 2 else step_seconds + extra)  # the warm-up steps (a compile) are slow
        ran += 1
        steps.end_step()
    return decisions, ran, runner


@pytest.fixture
def idle_machine(monkeypatch):
    """The machine's load as the test sets it (``idle_machine(2.0)``), idle until then."""
    load = {"now": 1.0}
    monkeypatch.setattr(machine_load, "slowdown", lambda: load["now"])
    return lambda value: load.update(now=value)


def test_a_check_matches_a_step_time_near_the_remembered_one_after_its_warm_up(step_clock, idle_machine):
    ((matches, record),) = run_check(step_clock, 0.004, expected_s=0.0042)[0]
    assert matches and record["decision"] == "matches" and record["check"] == "remembered"
    assert record["arm"] == "with" and record["steps"] == 2 + 2 * trials.BLOCK
    assert record["ratio"] == pytest.approx(0.004 / 0.0042, rel=0.2)  # the slow warm-up steps are not in it


def test_a_check_differs_from_steady_steps_clearly_slower_than_the_keep_promised(step_clock, idle_machine):
    decisions, ran, runner = run_check(step_clock, 0.012, expected_s=0.006)
    ((matches, record),) = decisions
    assert not matches and record["decision"] == "differs"
    assert ran == 2 + 2 * trials.BLOCK and runner.idle and runner.records == [record]


def test_a_check_matches_steps_faster_than_the_keep_promised_by_any_amount(step_clock, idle_machine):
    """A quieter machine than the deciding run's is no contradiction of a keep, nor a reason to pay
    for a trial again."""
    ((matches, record),) = run_check(step_clock, 0.0005, expected_s=0.006)[0]
    assert matches and record["decision"] == "matches" and record["ratio"] < 0.1


def test_a_check_on_a_busier_machine_expects_its_steps_slower_by_the_load(step_clock, idle_machine):
    """Twice the load then: steps twice as long are what the remembered decision predicts, not a
    contradiction; on the same load they are one."""
    idle_machine(2.0)
    ((matches, record),) = run_check(step_clock, 0.012, expected_s=0.006)[0]
    assert matches and record["load"] == 2.0 and record["load_remembered"] == 1.0
    ((matches, _),) = run_check(step_clock, 0.012, expected_s=0.006, load_then=2.0)[0]
    assert not matches


def test_a_check_whose_steps_stray_widens_its_tolerance_by_their_spread(step_clock, idle_machine):
    """Steady steps straying by half their median either way: 1.5x the remembered time is within it."""
    jitter = (0.0, 0.0045, -0.0045, 0.0045, -0.0045, 0.0)
    ((matches, record),) = run_check(step_clock, 0.009, expected_s=0.006, jitter=jitter)[0]
    assert matches and record["tolerance"] > 1.5
    ((matches, _),) = run_check(step_clock, 0.009, expected_s=0.006)[0]
    assert not matches  # the same median, steady: a contradiction


@pytest.mark.parametrize("jitter, kept", [(0.0, True), (0.004, False)])
def test_a_gain_within_the_arms_spread_is_not_kept(step_clock, jitter, kept):
    """Medians 20% apart (past MARGIN); steps that stray by more than that either way (a busy
    machine) leave the script as written, steady ones keep the candidate."""
    state, decisions, _ran, _runner = run_trial(step_clock, on_seconds=0.008, off_seconds=0.010, jitter=jitter)
    ((keep, record),) = decisions
    assert keep is kept and state["on"] is kept
    assert record["speedup"] == pytest.approx(1.25, rel=0.01)
    assert (record["spread_with"] > 0.3) is not kept


def test_a_trial_whose_one_off_passes_its_estimates_high_end_is_stopped_in_warm_up(step_clock, idle_machine):
    state, decisions, ran, runner = run_trial(
        step_clock, on_seconds=0.002, off_seconds=0.006, one_off=5.0, one_off_limit_s=2.0
    )
    ((keep, record),) = decisions
    assert not keep and not state["on"] and record["decision"] == "stopped"
    assert record["stopped"] == "one_off_overran" and record["one_off_s"] == pytest.approx(5.0, abs=0.01)
    assert ran == [False] * trials.BLOCK + [True]  # stopped after the step that paid it, nothing more
    assert record["arms"] == [["without", trials.BLOCK], ["warm-up", 1]] and runner.idle


def test_a_one_off_within_its_estimate_runs_the_whole_trial(step_clock):
    _state, decisions, ran, _runner = run_trial(
        step_clock, on_seconds=0.002, off_seconds=0.006, one_off=1.0, one_off_limit_s=2.0
    )
    ((keep, record),) = decisions
    assert keep and record["decision"] == "kept" and len(ran) == record["steps"]


def test_no_trial_starts_while_another_measurement_holds_the_steps(step_clock):
    """A unit's own work in the steps (fused_optimizer timing an update twice) would weigh on one arm:
    the trial starts at the step after its hold is released."""
    steps, started = FakeSteps(), []
    windows, timing = trials.StepWindows(steps), FakeUnit()
    assert windows.take(timing)
    runner = trials.TrialRunner(steps, steps.events, windows)
    runner.submit(trials.Trial(FakeUnit(), "fake", lambda on: started.append(steps.steps), lambda keep, record: None))
    assert not started and steps.listening and windows.holder is timing
    while steps.steps < 4:
        assert windows.take(timing) and not started  # the holder measures in each of its steps
        steps.end_step()
    windows.release(timing)
    steps.end_step()
    assert started == [5] and windows.holder is runner


# The steps' measurement windows: one holder at a time, refreshed by measuring, lost when stale.


def test_one_holder_at_a_time_until_it_releases():
    steps = FakeSteps()
    windows, first, second = trials.StepWindows(steps), FakeUnit(), FakeUnit()
    assert windows.take(first) and windows.take(first)  # taking again refreshes
    assert not windows.take(second) and windows.holder is first
    windows.release(second)  # only the holder releases
    assert windows.holder is first
    windows.release(first)
    assert windows.take(second) and windows.holder is second


def test_a_hold_not_refreshed_for_stale_steps_is_lost_to_the_next_asker():
    """An optimizer timed until it stopped stepping must not hold every other measurement back."""
    steps = FakeSteps()
    windows, stopped, asker = trials.StepWindows(steps), FakeUnit(), FakeUnit()
    assert windows.take(stopped)
    for _ in range(trials.STALE_STEPS - 1):
        steps.end_step()
        assert not windows.take(asker)
    steps.end_step()
    assert windows.take(asker) and windows.holder is asker


def test_a_yielding_hold_is_taken_by_any_asker_at_once_and_then_waits():
    """A loader's windows measure for one rank only: the census and the trials, which start at the
    same step on every rank, never wait for them."""
    steps = FakeSteps()
    windows, loader, census = trials.StepWindows(steps), FakeUnit(), FakeUnit()
    assert windows.take(loader, yields=True) and windows.take(loader, yields=True)
    assert windows.take(census) and windows.holder is census
    assert not windows.take(loader, yields=True)
    windows.release(census)
    assert windows.take(loader, yields=True)


def test_a_take_says_whether_another_measured_since_the_takers_previous_one():
    """A loader times each batch from its previous take: where a census step came in between, the
    period holds that step's work."""
    steps = FakeSteps()
    windows, loader, census = trials.StepWindows(steps), FakeUnit(), FakeUnit()
    assert windows.take(loader, yields=True) and not windows.interrupted  # the first take of all
    assert windows.take(loader, yields=True) and not windows.interrupted
    assert windows.take(census) and windows.interrupted  # census: the loader took last
    windows.release(census)
    assert windows.take(loader, yields=True) and windows.interrupted
    assert windows.take(loader, yields=True) and not windows.interrupted
    assert windows.take(census) and windows.interrupted and windows.take(census) and not windows.interrupted


def test_a_unit_switched_off_gives_the_steps_back_whatever_it_was_measuring():
    """The session's revert releases the windows, as it cancels the unit's trials: a fused update
    still timed when its unit fails holds nothing after."""
    import torch

    import autogaudi
    from autogaudi.entry import runtime

    autogaudi.enable(device="cpu", only="fused_optimizer", trial="fused_optimizer")
    session = runtime._STATE.session
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    unit = session.unit("fused_optimizer")
    assert session.windows.holder is unit  # timing its fused update against torch's
    unit.failed_at_run_time(RuntimeError("injected"))
    assert session.windows.holder is None


# The one rule, and the measurements outside trials the runner reads.


@pytest.mark.parametrize(
    "with_ms, without_ms, materiality, why",
    [
        ([9.8] * 4, [10.0] * 4, 0.0, "slower"),  # 2%: under the margin
        ([9.0, 12.0, 9.0, 12.0], [10.0, 13.0, 10.0, 13.0], 0.0, "within_spread"),  # 1 ms saved, 3 ms spread
        ([9.6] * 4, [10.0] * 4, 0.0, "kept"),  # 4%, no spread: the margin is enough for the numbers kept
        ([9.6] * 4, [10.0] * 4, trials.MATERIAL, "not_material"),  # but not for a change to the numbers
        ([9.4] * 4, [10.0] * 4, trials.MATERIAL, "kept"),
    ],
)
def test_decide_names_the_test_a_gain_fails(with_ms, without_ms, materiality, why):
    verdict = trials.decide([ms / 1000 for ms in with_ms], [ms / 1000 for ms in without_ms], materiality=materiality)
    assert verdict.why == why and verdict.keep is (why == "kept")


def test_a_change_to_the_numbers_is_material_against_the_step_it_is_given():
    """A fused update saving 2 ms of a 10 ms update is 20% of the update, 2% of a 100 ms step."""
    fused, unfused = [0.008] * 4, [0.010] * 4
    assert trials.decide(fused, unfused, materiality=trials.MATERIAL).keep
    assert trials.decide(fused, unfused, materiality=trials.MATERIAL, step_s=0.1).why == "not_material"


class Measured:
    """A measurement as the runner reads it: two facts, nothing else."""

    def __init__(self):
        self.deciding, self.done = False, False


def test_a_unit_is_pending_while_a_measurement_decides_and_decided_once_all_are_done():
    steps, unit = FakeSteps(), FakeUnit()
    runner = trials.TrialRunner(steps, steps.events)
    first, second = Measured(), Measured()
    runner.measuring(unit, first)
    runner.measuring(unit, second)
    assert not runner.pending(unit) and not runner.decided(unit)  # waiting for what it measures
    first.deciding = True
    assert runner.pending(unit) and not runner.decided(unit)
    first.deciding, first.done = False, True
    assert not runner.pending(unit) and not runner.decided(unit)  # the second is not done
    second.done = True
    assert runner.decided(unit)
    runner.cancel(unit)
    assert not runner.decided(unit)


def test_a_measurement_whose_subject_is_gone_is_nobodys_and_a_decision_marked_stays():
    steps, unit = FakeSteps(), FakeUnit()
    runner = trials.TrialRunner(steps, steps.events)
    measurement = Measured()
    measurement.deciding = True
    runner.measuring(unit, measurement)
    assert runner.pending(unit)
    del measurement  # held weakly: an optimizer dropped takes its update times with it
    assert not runner.pending(unit)
    runner.measured(unit)  # decided outside the steps (a forecast): stays decided
    assert runner.decided(unit) and not runner.pending(unit)
