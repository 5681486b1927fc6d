"""An optimizer's updates timed both ways, torch's unfused one (the run's) and the fused one (on
copies), and whether the fused update's gain is worth the rounding it would add to the run's
numbers: the trials' one rule (:func:`autogaudi.trials.keeps`) with the materiality of a change to
the numbers."""

from __future__ import annotations

from autogaudi import trials

# The share of the training step the fused update must save to be kept: a unit that changes the run's
# numbers does so only for a gain that matters to the run, and far enough from the line that a busy
# run does not read it on the other side (a CPU update's usual gain, ~1% of the step, flipped there).
MATERIAL_SHARE = 0.05


class UpdateTimes:
    """One optimizer's updates timed (seconds): torch's unfused one, the run's own, and the fused
    one on copies; ``steps``: its steps seen while deciding. A plain class, not a dataclass: the
    unit imports it at start, where making a dataclass costs more than the rest of its module."""

    def __init__(self, unfused=None, fused=None):
        self.unfused: list = [] if unfused is None else unfused
        self.fused: list = [] if fused is None else fused
        self.steps = 0


def gain_not_material(times: UpdateTimes, step_s) -> dict | None:
    """Why the fused update is not kept, as a reason's values, or None where it is: by the trials'
    rule with ``MATERIAL_SHARE`` of the step (``step_s``, the median training step measured
    meanwhile; None where no step was measured)."""
    if trials.keeps(times.fused, times.unfused, step_s, materiality=MATERIAL_SHARE):
        return None
    gain = trials.median(times.unfused) - trials.median(times.fused)
    noise = trials.spread(times.fused) + trials.spread(times.unfused)
    return {
        "gain": round(1000 * gain, 3),
        "step": None if step_s is None else round(1000 * step_s, 3),
        "share": MATERIAL_SHARE,
        "spread": round(1000 * noise, 3),
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
