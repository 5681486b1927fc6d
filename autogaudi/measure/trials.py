"""Every measurement autogaudi makes inside the user's steps, run by one runner under one rule.

Why: whether torch.compile, channels_last, a fused update or loader workers pay off depends on the
model, the machine and its load; no static rule gets that right, so each is measured on the run's own
steps. Every measurement holds the steps' windows (:class:`StepWindows`) while it runs, so none reads
another's work as its own, and every decision is :func:`decide`'s: at least ``MARGIN`` faster, by
more than the arms' spread together, and, for a change to the run's numbers, by ``MATERIAL`` of the
step (a gain no plausible noise flips, so quiet and busy runs decide alike).

A trial flips a unit's ``switch(on)`` between real training steps, in blocks of ``BLOCK`` steps in the
order on-off-off-on (drift cancels), after ``WARMUP`` "on" steps that absorb the one-off cost (a
compile), measured and reported apart. The "without" arm is the faster of the off steps between on
steps and a block timed before the candidate was ever on (an "off" arm can be slowed by what the "on"
arm left behind). A trial whose one-off runs past its estimate's high end is stopped and not kept.
Trial steps are the user's real steps, each batch seen once; trials run one at a time, in the order
asked, timed boundary to boundary with no added device synchronisation. On distributed runs each rank
measures its own steps and rank 0's decision is broadcast, so every rank runs the same code path.
The run is settled when the runner has nothing left to run and no unit measures (:attr:`idle`).
"""

from __future__ import annotations

import typing
import weakref

from autogaudi.core.events import Event
from autogaudi.entry.ranks import rank_zero_choice, several_ranks
from autogaudi.measure import clock, machine_load

BLOCK = 3  # steps per block
ROUNDS = 2  # each round is on, off, off, on
WARMUP = 3  # "on" steps before measuring (compile, CUDA-graph warm-up and recording)
MARGIN = 0.03  # the candidate must be this much faster to be kept
# The share of the training step a change to the run's numbers must save to be kept (every unit that
# can change them, by trial, timing or window alike): far enough from the margin that a busy run does
# not read it on the other side (a CPU fused update's usual gain, ~1% of the step, flipped there).
MATERIAL = 0.05
# a remembered step time still holds while this run's is within this factor of it, widened by this
# run's own spread and by the load then and now
CHECK_TOLERANCE = 1.25


def median(values) -> float:
    """``statistics.median``. The module is imported at the first median, not at start: it loads
    ``fractions`` and ``decimal``, which a run that measures nothing would pay for at every start."""
    import statistics

    return statistics.median(values)


def spread(seconds: list) -> float:
    """How far times stray from their median (the median absolute deviation): outliers in fewer than
    half of them (a preemption) do not move it."""
    middle = median(seconds)
    return median(abs(value - middle) for value in seconds)


def relative_spread(seconds: list) -> float:
    """:func:`spread` as a fraction of the median (0 where the median is)."""
    middle = median(seconds)
    return round(spread(seconds) / middle, 4) if middle else 0.0


class Verdict(typing.NamedTuple):
    """What :func:`decide` found: ``why`` is ``kept``, ``slower`` (not ``margin`` faster on the
    medians), ``within_spread`` (a gain inside the arms' spread together) or ``not_material`` (a change
    to the numbers saving less than its share of the step); ``gain_s`` and ``spread_s`` the figures."""

    keep: bool
    why: str
    gain_s: float
    spread_s: float


def decide(with_times: list, without_times: list, margin: float = MARGIN, materiality: float = 0.0, step_s=None):
    """The one rule every measured decision takes (a trial's arms, a fused update timed on copies, a
    loader's windows): ``with`` is kept only where its median is at least ``margin`` faster than
    ``without``'s, by more than the two arms' spread together (a gain inside the noise of a busy
    machine is not one), and, for a change to the run's numbers (``materiality`` > 0, the unit's
    :data:`MATERIAL`), by at least that share of the training step (``step_s``; None: the ``without``
    median). A change to the numbers that saves less is not worth them, and one that saves that much
    stays clear of the margin and of the spread on a busy machine: a quiet and a busy run decide alike."""
    with_s, without_s = median(with_times), median(without_times)
    gain, noise = without_s - with_s, spread(with_times) + spread(without_times)
    if with_s > without_s * (1 - margin):
        why = "slower"
    elif gain <= noise:
        why = "within_spread"
    elif materiality and gain < materiality * (without_s if step_s is None else step_s):
        why = "not_material"
    else:
        why = "kept"
    return Verdict(why == "kept", why, gain, noise)


def materiality_of(unit) -> float:
    """The share of the step a unit's change must save: :data:`MATERIAL` for one that can change the
    run's numbers on this backend, 0 for one that leaves them as they are."""
    return MATERIAL if unit.numerics_on(unit.run.backend) else 0.0


STALE_STEPS = 16  # steps after which a hold not refreshed is lost to the next asker


class StepWindows:
    """Who measures the training steps now: one holder at a time for every measurement autogaudi
    makes inside them (a trial's arms, a fused update timed on copies, a loader's windows, the
    profiler's census), since each would read another's work as the step's own. A holder refreshes
    its hold at every step it measures; one that has not for ``STALE_STEPS`` steps (an optimizer timed
    until it stopped stepping) loses it to the next asker. A holder that measures what only its own
    process decides (a loader's batches) ``yields``: any other asker takes the steps at once (on a
    distributed run the census and the trials start at the same step on every rank)."""

    def __init__(self, steps):
        self._steps = steps  # the session's step watcher: its count is the steps' clock here
        self.holder = None
        self._used_at = 0
        self._yields = False
        self._last_taker = None
        # at the latest take: whether another holder took the steps since the taker's previous take
        self.interrupted = False

    def take(self, owner, yields: bool = False) -> bool:
        """Hold the steps for ``owner`` from this step (True), or False while another holds them.
        Taking again refreshes the hold; ``yields``: any other asker may take it at once. A holder that
        times a period from its previous take (a loader's batch) reads :attr:`interrupted`: where
        another measured in between, the period holds that one's work."""
        if self.holder is not None and self.holder is not owner and not (self._yields or self._stale()):
            return False
        self.interrupted = self._last_taker is not None and self._last_taker is not owner
        self.holder, self._used_at, self._yields, self._last_taker = owner, self._steps.steps, yields, owner
        return True

    def release(self, owner) -> None:
        if self.holder is owner:
            self.holder = None

    @property
    def measuring(self) -> bool:
        """Whether a measurement holds the steps now (a stale hold measures nothing)."""
        return self.holder is not None and not self._stale()

    def holder_name(self) -> str:
        return getattr(self.holder, "name", type(self.holder).__name__)

    def _stale(self) -> bool:
        return self._steps.steps - self._used_at >= STALE_STEPS


class Trial:
    """One A/B trial: ``switch(on: bool)`` flips the candidate; ``decided(keep, record)`` is told the outcome."""

    words = ("rejected", "kept")  # the record's decision, for False and True

    def __init__(
        self,
        unit,
        candidate: str,
        switch,
        decided,
        set_up_s: float = 0.0,
        one_off_limit_s=None,
        materiality: float = 0.0,
    ):
        self.unit = unit
        self.candidate = candidate
        self.switch = switch
        self.decided = decided
        self.set_up_s = set_up_s  # what setting the candidate up took, outside the user's steps
        # the high end of the one-off's estimate: stopped beyond it (None or 0: an estimate that says nothing)
        self.one_off_limit_s = one_off_limit_s
        self.materiality = materiality  # :func:`decide`'s, for a candidate that changes the numbers
        self.overran = False
        self.one_off_so_far = 0.0  # in warm-up, where a limit is set: what the one-off has cost until now
        self.schedule = (
            [False] * BLOCK
            + [True] * WARMUP
            + [arm for _ in range(ROUNDS) for arm in (True, False, False, True) for _ in range(BLOCK)]
        )
        self.before: list = []  # "off" steps before the candidate was ever on
        self.times = {True: [], False: []}
        self.warmup_seconds = 0.0
        self.position = 0
        self.started_at_step = None

    def record(self, seconds: float) -> None:
        """The step just finished ran with ``schedule[position]``."""
        on = self.schedule[self.position]
        if self.position < BLOCK:
            self.before.append(seconds)
        elif self.position < BLOCK + WARMUP:
            self.warmup_seconds += seconds
        else:
            self.times[on].append(seconds)
        self.position += 1

    def arms(self) -> list:
        """The schedule as runs of [arm, steps], the arm ``with``, ``without`` or ``warm-up`` (the
        first "with" steps, which absorb the one-off): what the report's chart shades."""
        runs: list = []
        for position, on in enumerate(self.schedule[: self.position]):
            arm = self._arm(position, on)
            if runs and runs[-1][0] == arm:
                runs[-1][1] += 1
            else:
                runs.append([arm, 1])
        return runs

    def _arm(self, position: int, on: bool) -> str:
        if BLOCK <= position < BLOCK + WARMUP:
            return "warm-up"
        return "with" if on else "without"

    @property
    def finished(self) -> bool:
        return self.position >= len(self.schedule) or self.overran

    def check_one_off(self) -> None:
        """In warm-up: stop where the one-off paid so far (set-up, and warm-up beyond the steps timed
        before it) is past the estimate's high end."""
        warm = self.position - BLOCK
        # not across ranks: each would stop at a step of its own, and their trials' steps must agree
        if not self.one_off_limit_s or not 0 < warm <= WARMUP or several_ranks():
            return
        self.one_off_so_far = self.set_up_s + self.warmup_seconds - warm * median(self.before)
        self.overran = self.one_off_so_far > self.one_off_limit_s

    def outcome(self) -> tuple:
        """(keep, record) from the medians; the one-off cost is what warm-up took beyond steady steps.
        The record's ``decision`` is the runner's to write: on a distributed run rank 0's counts."""
        if self.overran:
            return False, self._overran_record()
        on, interleaved = median(self.times[True]), median(self.times[False])
        before = median(self.before)
        without = self.times[False] if interleaved <= before else self.before
        off = min(interleaved, before)
        keep = decide(self.times[True], without, materiality=self.materiality).keep
        one_off = self.set_up_s + max(0.0, self.warmup_seconds - WARMUP * on)
        record = {
            "candidate": self.candidate,
            "ms_per_step_with": round(1000 * on, 3),
            "ms_per_step_without": round(1000 * off, 3),
            "ms_per_step_without_interleaved": round(1000 * interleaved, 3),
            "ms_per_step_before_trial": round(1000 * before, 3),
            "spread_with": relative_spread(self.times[True]),
            "spread_without": relative_spread(without),
            "speedup": round(off / on, 3),
            "one_off_s": round(one_off, 3),
            "set_up_s": round(self.set_up_s, 3),
            "steps": len(self.schedule),
            "load": machine_load.slowdown(),
        }
        if keep and one_off > 0:
            record["pays_back_after_steps"] = round(one_off / (off - on))
        return keep, record

    def _overran_record(self) -> dict:
        """The record of a trial stopped in its warm-up: what the one-off cost until then, no speeds."""
        return {
            "candidate": self.candidate,
            "stopped": "one_off_overran",
            "one_off_s": round(self.one_off_so_far, 3),
            "one_off_limit_s": round(self.one_off_limit_s, 3),
            "ms_per_step_without": round(1000 * median(self.before), 3),
            "speedup": None,
            "set_up_s": round(self.set_up_s, 3),
            "steps": self.position,
            "load": machine_load.slowdown(),
        }


class Check(Trial):
    """A remembered kept decision, checked on this run: the unit already follows it; after ``warmup``
    steps (a remembered capture's compile; early steps' noise) ``2 * BLOCK`` steps are timed, and
    their median is set against the step time the deciding trial measured with the candidate.
    ``decided(matches, record)``: only where this run is clearly slower than it (beyond
    ``CHECK_TOLERANCE``, widened by this run's spread and by the load then and now) does the unit
    try again. A run faster than remembered does not contradict a keep: a quieter machine than the
    deciding run's is no reason to pay for a trial again."""

    words = ("differs", "matches")

    def __init__(self, unit, candidate: str, expected_s: float, decided, warmup: int, load_then: float = 1.0):
        super().__init__(unit, candidate, switch=lambda _on: None, decided=decided)
        self.expected_s = expected_s
        self.load_then = load_then
        self.warmup = warmup
        self.schedule = [True] * (warmup + 2 * BLOCK)
        self.steady: list = []

    def _arm(self, position: int, on: bool) -> str:
        return "warm-up" if position < self.warmup else "with"

    def record(self, seconds: float) -> None:
        if self.position < self.warmup:
            self.warmup_seconds += seconds
        else:
            self.steady.append(seconds)
        self.position += 1

    def outcome(self) -> tuple:
        measured = median(self.steady)
        load_now = machine_load.slowdown()
        expected = self.expected_s * load_now / self.load_then
        tolerance = CHECK_TOLERANCE * (1 + 2 * relative_spread(self.steady))
        ratio = measured / expected
        return ratio <= tolerance, {
            "candidate": self.candidate,
            "check": "remembered",
            "arm": "with",
            "ms_per_step": round(1000 * measured, 3),
            "ms_per_step_remembered": round(1000 * self.expected_s, 3),
            "load": load_now,
            "load_remembered": self.load_then,
            "ratio": round(ratio, 3),
            "tolerance": round(tolerance, 3),
            "steps": len(self.schedule),
        }


class _Done:
    """A measurement decided outside the steps: nothing left to run."""

    deciding, done = False, True


_DONE = _Done()


class TrialRunner:
    """Runs the session's trials one after another at optimizer-step boundaries."""

    name = "trials"  # as the step windows name their holder

    def __init__(self, steps, events, windows=None):
        self.steps = steps
        self.events = events
        # A trial or check starts once it can hold the steps: another measurement's work in them would
        # be in one arm's times only.
        self.windows = windows if windows is not None else StepWindows(steps)
        self.queue: list = []
        self.current = None
        self._running = None  # the handle of the running trial's step listener
        self._waiting = None  # the handle of the listener that looks for a trial whose step has come
        self.last_clock = None
        self.records: list = []
        self._measurements: dict = {}  # unit -> its measurements outside trials (see measuring())

    def submit(self, trial: Trial) -> None:
        self.queue.append(trial)
        if self.current is None:
            self._stop_waiting()
            self._start_next()

    def _start_next(self) -> None:
        """Start the first queued trial once the runner holds the steps; while another measurement
        holds them, look again after every step (a waiting trial's unit owns that listener until some
        trial starts)."""
        self.current = self.queue[0] if self.queue and self.windows.take(self) else None
        if self.current is None:
            self.windows.release(self)
        if self.current is not None:
            self.queue.remove(self.current)
            self.current.started_at_step = self.steps.steps
            self.steps.timeline.mark(self.steps.steps, self.current.candidate, "trial_started")
            self.last_clock = None
            self._running = self.events.on(Event.TRAINING_STEP, self.current.unit, self._after_step)
            self._flip(self.current.schedule[0])
        elif self.queue:
            self._waiting = self.events.on(Event.TRAINING_STEP, self.queue[0].unit, self._look_again)

    def _look_again(self, _optimizer) -> None:
        if self.windows.take(self):
            self._stop_waiting()
            self._start_next()

    def _stop_waiting(self) -> None:
        if self._waiting is not None:
            self._waiting.remove()
            self._waiting = None

    def _flip(self, on: bool) -> None:
        self.current.switch(on)
        self.last_clock = clock.now()  # the switch itself is not part of either arm's step

    def _after_step(self, _optimizer) -> None:
        trial = self.current
        self.windows.take(self)  # still measuring: the hold stays fresh
        trial.record(clock.now() - self.last_clock)
        trial.check_one_off()
        if not trial.finished:
            upcoming = trial.schedule[trial.position]
            if upcoming != trial.schedule[trial.position - 1]:
                self._flip(upcoming)
            else:
                self.last_clock = clock.now()
            return
        keep, record = trial.outcome()
        keep = bool(rank_zero_choice(keep))
        record["decision"] = "stopped" if trial.overran else trial.words[keep]
        record["started_at_step"] = trial.started_at_step
        record["arms"] = trial.arms()
        self.records.append(record)
        self._running.remove()
        trial.switch(keep)
        trial.decided(keep, record)
        self._start_next()

    def measuring(self, unit, measurement) -> None:
        """``measurement`` decides for ``unit`` outside a trial, as data the runner reads: its
        ``deciding`` (measuring now, or about to) and ``done`` (decided, nothing left to measure).
        A loader's windows, an optimizer's update times, the step profile, the memory forecast. Held
        weakly: a measurement whose subject is gone (an optimizer dropped) is no longer the unit's."""
        self._measurements.setdefault(unit, weakref.WeakSet()).add(measurement)

    def pending(self, unit) -> bool:
        """Whether ``unit`` has something left for the runner: a trial running or waiting to start,
        or a measurement deciding."""
        if any(trial.unit is unit for trial in (self.current, *self.queue) if trial is not None):
            return True
        return any(measurement.deciding for measurement in self._measurements.get(unit, ()))

    def measured(self, unit) -> None:
        """``unit`` decided on what it measured outside the steps (a memory forecast, a remembered
        decision): nothing left to run for it."""
        self.measuring(unit, _DONE)

    def decided(self, unit) -> bool:
        """Whether ``unit``'s measurements outside trials are all done (at least one)."""
        measurements = list(self._measurements.get(unit, ()))
        return bool(measurements) and all(measurement.done for measurement in measurements)

    def trying(self, unit) -> bool:
        """Whether a trial of ``unit`` (not a check of a remembered decision, which it follows) is
        running or waiting to start: its candidate is not yet the run's."""
        return any(
            trial.unit is unit and not isinstance(trial, Check)
            for trial in (self.current, *self.queue)
            if trial is not None
        )

    @property
    def idle(self) -> bool:
        """No trial running or queued (the queue only waits behind a running trial)."""
        return self.current is None and not self.queue

    def cancel(self, unit) -> None:
        """Drop a unit's trials and measurements (the unit was reverted)."""
        self._measurements.pop(unit, None)
        self.queue = [trial for trial in self.queue if trial.unit is not unit]
        if self.current is not None and self.current.unit is unit:
            self._running.remove()
            self._start_next()
        elif self.current is None:
            self._stop_waiting()
            self._start_next()
