"""What the unit knows of one loader it may tune: its phase, and the batches timed in each window."""

from __future__ import annotations

import enum
import weakref


class Phase(enum.Enum):
    MEASURING = "measuring"  # in-process, timed
    NEXT_EPOCH = "next epoch"  # raised in place; the running epoch keeps the script's workers
    CHECKING = "checking"  # tuned, timed again
    DONE = "done"


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

    @property
    def ms_per_batch(self) -> float:
        return 1000 * (self.waited + self.computed) / max(self.batches, 1)


class LoaderState:
    """One loader the unit measures, held weakly, and what tuning it changed: a measurement the
    runner reads (``deciding``, ``done``: :meth:`autogaudi.measure.trials.TrialRunner.measuring`)."""

    def __init__(self, loader):
        self.loader = weakref.ref(loader)  # the script owns the loader; this must not keep it alive
        # MEASURING -> [NEXT_EPOCH (raised in place, from its next epoch)] -> CHECKING -> DONE
        self.phase = Phase.MEASURING
        self.windows = {Phase.MEASURING: Timing(), Phase.CHECKING: Timing()}
        self.epoch_batches = 0
        self.last_end = None
        self.before = None  # (random state, dataset state) before a measured batch
        self.getitem_changes = None  # (reason code, values) once a measured __getitem__ changed state
        self.scope = None  # what tuning this loader changed, while tuned
        self.workers = 0

    @property
    def timed(self) -> bool:
        """Whether a window of its batches is being timed: begun, and not yet decided."""
        measuring = self.phase is Phase.MEASURING and self.windows[Phase.MEASURING].batches > 0
        return measuring or self.phase is Phase.CHECKING

    @property
    def deciding(self) -> bool:
        """Timed, or raised in place and waiting for the epoch that times it."""
        return self.timed or self.phase is Phase.NEXT_EPOCH

    @property
    def done(self) -> bool:
        """Decided: kept in-process, tuned and checked, or put back."""
        return self.phase is Phase.DONE
