"""The run as a line: each training step's seconds and the moments autogaudi acted, for the report's
chart (``--report run.html``) and its JSON.

Why bounded: a run of a million steps must not grow the report (or the memory) with it, so past
``MAX_POINTS`` points neighbours are merged two by two and each point stands for twice as many
steps (their mean); the events are few (a profile, a handful of trials, a fall-back) and kept up to
``MAX_EVENTS``.

Why two flat lists: a point per step as a pair object would hand the garbage collector a tracked
object every step. A short run that allocates nothing net otherwise then pays the full collection
that importing torch left due (85-97 ms on the 2-core CPU) where plain PyTorch would not; floats and
ints in a list are not tracked.

Autogaudi's own time outside the steps' measured parts is kept here too: its start (its imports
before the script, its work when the script imports torch: :func:`add_start_up`) and the time its
per-call wrappers and hooks take inside the user's calls (each watcher's running total, read at the
report), so the report's own cost holds everything autogaudi adds.
"""

from __future__ import annotations

import time

ENTERED = time.perf_counter()  # the package imports this module first: autogaudi's start begins here
MAX_POINTS = 1000
MAX_EVENTS = 200
_START_UP: list = [0.0]  # seconds of autogaudi's start in this process
_CLAIMED: list = [0.0]  # of those, what sessions that have ended counted as theirs


def add_start_up(seconds: float) -> None:
    """``seconds`` more of autogaudi's start in this process (its imports, its session's start)."""
    _START_UP[0] += seconds


def entered_until_now() -> None:
    """Count the time from autogaudi's first import until now as its start (the launcher, before the
    script; the environment's bootstrap, before the program)."""
    add_start_up(time.perf_counter() - ENTERED)


def start_up_s() -> float:
    return _START_UP[0]


class Timeline:
    def __init__(self):
        self.every = 1  # training steps per point
        self._seconds: list = []  # per point: its steps' seconds in all
        self._steps: list = []  # per point: how many steps it stands for
        self.events: list = []  # {"step", "unit", "event", ...params}, in the order they happened
        self.events_left_out = 0
        # where the first step's time starts: "batch" (the last batch fetched before the first
        # backward pass: its forward and lazy initialisation included) or "start" (autogaudi's start,
        # where no DataLoader feeds the loop; an evaluation before training is left out either way)
        self.first_step_from = "start"
        self._own_work: list = []  # callables: each watcher's seconds inside the user's calls so far
        # this session's start: the process's not counted by an earlier session, until this one ends
        self._start_up_from, self._start_up_until = _CLAIMED[0], None

    def count_own_work(self, seconds) -> None:
        """Count ``seconds()`` (a watcher's running total of its time inside the user's calls) as
        autogaudi's own per-call work."""
        self._own_work.append(seconds)

    @property
    def per_call_s(self) -> float:
        return sum(seconds() for seconds in self._own_work)

    def step(self, seconds: float) -> None:
        """One more training step, ``seconds`` long (boundary to boundary)."""
        if self._steps and self._steps[-1] < self.every:
            self._seconds[-1] += seconds
            self._steps[-1] += 1
            return
        self._seconds.append(seconds)
        self._steps.append(1)
        if len(self._steps) > MAX_POINTS:
            paired = len(self._steps) // 2 * 2
            self._seconds[:paired] = [a + b for a, b in zip(self._seconds[:paired:2], self._seconds[1:paired:2])]
            self._steps[:paired] = [a + b for a, b in zip(self._steps[:paired:2], self._steps[1:paired:2])]
            self.every *= 2

    def mark(self, step: int, unit: str, event: str, **params) -> None:
        """Something ``unit`` did after training step ``step``; ``event`` is a code, ``params`` JSON values."""
        if len(self.events) >= MAX_EVENTS:
            self.events_left_out += 1
            return
        self.events.append({"step": step, "unit": unit, "event": event, **params})

    def add_to_mark(self, step: int, unit: str, event: str, **counts) -> None:
        """:meth:`mark`, or where the last mark is the same event at the same step, its ``counts``
        added to that one's (an evaluation loop that enters ``no_grad`` per batch makes one mark)."""
        last = self.events[-1] if self.events else None
        if last is not None and (last["step"], last["unit"], last["event"]) == (step, unit, event):
            for name, count in counts.items():
                last[name] = last.get(name, 0) + count
            return
        self.mark(step, unit, event, **counts)

    @property
    def start_up_s(self) -> float:
        """autogaudi's start counted for this session: a session enabled again in the same process
        counts its own start, not the first one's."""
        until = self._start_up_until if self._start_up_until is not None else start_up_s()
        return until - self._start_up_from

    def close(self) -> None:
        """The session ended: its start is fixed, and a later session's starts from here."""
        if self._start_up_until is None:
            self._start_up_until = _CLAIMED[0] = start_up_s()

    @property
    def seconds(self) -> float:
        """The steps' seconds in all: the run's training time, one-offs included."""
        return sum(self._seconds)

    def as_dict(self) -> dict:
        return {
            "every": self.every,
            "step_s": [round(total / count, 6) for total, count in zip(self._seconds, self._steps)],
            "first_step_from": self.first_step_from,
            "events": list(self.events),
            "events_left_out": self.events_left_out,
            "start_up_s": round(self.start_up_s, 4),
            "per_call_s": round(self.per_call_s, 4),
        }
