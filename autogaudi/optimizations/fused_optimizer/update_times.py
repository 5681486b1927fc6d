"""An optimizer's updates timed both ways, torch's unfused one (the run's) and the fused one (on
copies), decided by the runner's one rule (:func:`autogaudi.measure.trials.decide`) with the materiality of
a change to the run's numbers (:data:`autogaudi.measure.trials.MATERIAL` of the training step)."""

from __future__ import annotations

import math
import weakref

from autogaudi.measure import trials


class UpdateTimes:
    """One optimizer's updates timed (seconds): torch's unfused one, the run's own, and the fused
    one on copies; ``steps``: its steps seen while deciding. The measurement the runner reads
    (:meth:`autogaudi.measure.trials.TrialRunner.measuring`): ``deciding`` while its optimizer lives and is
    timed, ``done`` once decided. A plain class, not a dataclass: the unit imports it at start, where
    making a dataclass costs more than the rest of its module."""

    def __init__(self, unfused=None, fused=None, optimizer=None):
        self.unfused: list = [] if unfused is None else unfused
        self.fused: list = [] if fused is None else fused
        self.steps = 0
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else lambda: None
        self.timing = optimizer is not None  # False once decided, or given back untimed
        self.done = False

    @property
    def deciding(self) -> bool:
        return self.timing and self._optimizer() is not None

    def stop(self, decided: bool) -> None:
        """No longer timed: ``decided`` (kept or put back), or given back untimed (not decided)."""
        self.timing, self.done = False, decided


def why_not_fused(times: UpdateTimes, step_s) -> tuple | None:
    """Why the fused update is not kept, as (reason code, its values), or None where it is:
    ``fused_slower`` where it is not the rule's margin faster on the medians, ``gain_not_material``
    where its gain is within the arms' spread or under ``MATERIAL`` of the step (``step_s``, the median
    training step measured meanwhile; None where none was: not shown material)."""
    verdict = trials.decide(
        times.fused, times.unfused, materiality=trials.MATERIAL, step_s=math.inf if step_s is None else step_s
    )
    if verdict.keep:
        return None
    fused, unfused = trials.median(times.fused), trials.median(times.unfused)
    if verdict.why == "slower":
        return "fused_slower", {"fused": round(1000 * fused, 3), "unfused": round(1000 * unfused, 3)}
    return "gain_not_material", {
        "gain": round(1000 * verdict.gain_s, 3),
        "step": None if step_s is None else round(1000 * step_s, 3),
        "share": trials.MATERIAL,
        "spread": round(1000 * verdict.spread_s, 3),
    }


def update_ms(timed: list) -> dict:
    """The ``update_ms`` figure of the optimizers ``timed`` (their UpdateTimes): the medians of their
    fused and unfused updates, in ms, and how many fused ones were timed."""
    fused = [seconds for times in timed for seconds in times.fused]
    unfused = [seconds for times in timed for seconds in times.unfused]
    return {
        "unfused": round(1000 * trials.median(unfused), 3),
        "fused": round(1000 * trials.median(fused), 3),
        "steps": len(fused),
    }
