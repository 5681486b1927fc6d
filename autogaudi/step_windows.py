"""Who measures the training steps now: one holder at a time for every measurement autogaudi makes.

Why: each measurement inside the user's steps — a trial's arms, a fused update timed against torch's
unfused one on copies, the profiler's census — would read another's work as the step's own (an
update run twice weighs on one trial arm only; a census's dispatch mode slows what a timing times).
So a measurement holds the steps while it runs and the others wait, instead of each asking the others
whether they are busy. A holder refreshes its hold at every step it measures; one that has not for
``STALE_STEPS`` steps (an optimizer timed until it stopped stepping) loses it to the next asker.
A holder that measures what only its own process decides (a loader's batches) yields: any other
asker takes the steps from it at once. On a distributed run the census and the trials start at the
same step on every rank, and must not wait for what one rank's loader does.
"""

from __future__ import annotations

STALE_STEPS = 16


class StepWindows:
    def __init__(self, steps):
        self._steps = steps  # the session's step watcher: its count is the steps' clock here
        self.holder = None
        self._used_at = 0
        self._yields = False

    def take(self, owner, yields: bool = False) -> bool:
        """Hold the steps for ``owner`` from this step (True), or False while another holds them.
        Taking again refreshes the hold; ``yields``: any other asker may take it at once."""
        if self.holder is not None and self.holder is not owner and not (self._yields or self._stale()):
            return False
        self.holder, self._used_at, self._yields = owner, self._steps.steps, yields
        return True

    def release(self, owner) -> None:
        if self.holder is owner:
            self.holder = None

    def holder_name(self) -> str:
        return getattr(self.holder, "name", type(self.holder).__name__)

    def _stale(self) -> bool:
        return self._steps.steps - self._used_at >= STALE_STEPS
