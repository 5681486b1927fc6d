"""What the unit knows of one loader it may tune: where it stands in the lifecycle every measured
choice shares (:class:`autogaudi.core.candidate.State`), and the batches timed in each window."""

from __future__ import annotations

import math
import weakref

from autogaudi.core.candidate import State
from autogaudi.measure.trials import median, spread


class Timing:
    """Waiting vs computing for one loader over a window of batches."""

    def __init__(self):
        self.batches = 0
        self.waited = 0.0
        self.computed = 0.0
        self.seconds: list = []  # each batch's time, waiting and computing: the trials' rule reads them

    def add(self, waited: float, computed: float) -> None:
        self.batches += 1
        self.waited += waited
        self.computed += computed
        self.seconds.append(waited + computed)

    def rounds(self, size: int) -> list:
        """The mean batch time over each ``size`` consecutive batches (a trailing part dropped unless
        it is all there is). Workers hand batches over in turn, each after its own build: one batch
        waits the whole build and the next comes at once, so single batches alternate long and short
        and their spread hides the gain; a round of one batch per worker is the loader's period."""
        size = max(1, size)
        whole = len(self.seconds) - len(self.seconds) % size or len(self.seconds)
        return [sum(self.seconds[i : i + size]) / len(self.seconds[i : i + size]) for i in range(0, whole, size)]

    @property
    def input_bound(self) -> float:
        return self.waited / max(self.waited + self.computed, 1e-12)

    def ms_per_batch(self, workers: int) -> float:
        """The loader's period, as the rule reads it: the median of rounds of one batch per worker. A
        window is a few batches, and a one-off among them (a worker's start, the checks before
        tuning) would stand for every batch of the run in a mean."""
        return 1000 * median(self.rounds(workers)) if self.batches else 0.0


def period_noise_ms(before: Timing, after: Timing, workers: int) -> float:
    """The noise of the two windows' periods together (ms): each one's rounds' spread, as a trial's
    arms have theirs. A few batches timed early in a run stand for every batch after them; on a busy
    machine they scatter by half their period, and so would the saving that reads them."""
    return math.hypot(*(1000 * spread(window.rounds(workers)) if window.batches else 0.0 for window in (before, after)))


class LoaderState:
    """One loader the unit measures, held weakly, and what tuning it changed: a measurement the
    runner reads (``deciding``, ``done``: :meth:`autogaudi.measure.trials.TrialRunner.measuring`)."""

    def __init__(self, loader):
        self.loader = weakref.ref(loader)  # the script owns the loader; this must not keep it alive
        # WAITING (in-process, timed) -> TRIAL (workers, timed again; a script's own workers raised in
        # place from its next epoch) -> ON (kept) or RELEASED (put back); REFUSED: kept in-process
        self.lifecycle = State.WAITING
        self.from_next_epoch = False  # in its trial, raised in place: timed from the next epoch
        self.in_process, self.with_workers = Timing(), Timing()
        self.epoch_batches = 0
        self.last_end = None
        self.before = None  # (random state, dataset state) before a measured batch
        self.getitem_changes = None  # (reason code, values) once a measured __getitem__ changed state
        self.scope = None  # what tuning this loader changed, while tuned
        self.workers = 0

    @property
    def window(self):
        """The window its batches are timed into now, or None."""
        if self.lifecycle is State.WAITING:
            return self.in_process
        return self.with_workers if self.lifecycle is State.TRIAL and not self.from_next_epoch else None

    def holds_steps(self, waited: float, now: float, starved: float) -> bool:
        """Whether its window keeps the steps from other measurements (on one process): with workers on
        trial, or in-process while waiting for data is at least ``starved`` of its time, the batch just
        fetched (``waited``, ending ``now``) included. A clearly starved loader's batches are the run's
        slowest, so it is tuned before the census and the trials measure the step; any other gives the
        steps to them at once, since holding them would delay every other decision."""
        if self.lifecycle is State.TRIAL:
            return True
        if self.lifecycle is not State.WAITING or self.last_end is None:
            return False
        timing, period = self.in_process, now - self.last_end
        return (timing.waited + waited) / max(timing.waited + timing.computed + period, 1e-12) >= starved

    @property
    def timed(self) -> bool:
        """Whether a window of its batches is being timed: begun, and not yet decided."""
        window = self.window
        return window is not None and (window is self.with_workers or window.batches > 0)

    @property
    def deciding(self) -> bool:
        """Timed, or raised in place and waiting for the epoch that times it."""
        return self.timed or self.lifecycle is State.TRIAL

    @property
    def done(self) -> bool:
        """Decided: kept in-process, tuned and kept, or put back."""
        return self.lifecycle in (State.ON, State.RELEASED, State.REFUSED)
