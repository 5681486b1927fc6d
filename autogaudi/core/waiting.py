"""A unit loaded at the first event it acts on, not at the start.

Why: every module a start imports costs every run twice, its import and its share of the first
step's scan of all modules (torch.optim's constructor imports torch's compiler, which reads each
one); a one-step script does not build a DataLoader or reach a step profile. A unit whose registry
row says which events it ``waits_for`` is imported, constructed and started by the session at the
first of them, and hears that event as if it had been listening since the start.
"""

from __future__ import annotations

import functools

from autogaudi.core.events import Event


class WaitingUnit:
    """One unit's wait: listeners at the place the unit starts in (so that, loaded, it hears the
    event where it would have), removed at the first event or when the session stops. The guard's
    owner of those listeners."""

    in_force = True

    def __init__(self, session, info, place: int):
        self._session = session
        self._info = info
        self._place = place
        session.events.rank(self, place)
        events = [Event[name] for name in info.waits_for]
        self._handles = [session.events.on(event, self, functools.partial(self._came, event)) for event in events]

    def _came(self, event: Event, *args):
        self.cancel()
        unit = self._session.start_waiting(self._info, self._place)
        return self._session.events.hand_to(unit, event, *args) if unit is not None else None

    def cancel(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def failed_at_run_time(self, error: Exception) -> None:
        """Loading or starting the unit raised past the session's own handling: the unit stays out."""
        self.cancel()
        self._session.unit_not_started(self._info, error)
