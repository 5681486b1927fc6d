"""Every optimization unit autogaudi knows, as data, in the order they are applied.

The registry names each unit and says in one line what it does; the unit's module (imported only
once torch is imported) says what it patches, when it applies, and how it is undone. Keeping the
list here, free of torch imports, lets option validation and ``--help`` run before torch loads.
"""
from __future__ import annotations

from typing import NamedTuple


class UnitInfo(NamedTuple):
    name: str
    summary: str
    module: str  # "package.module:Class"


UNITS: tuple[UnitInfo, ...] = (
    UnitInfo(
        "step_marks",
        "HPU lazy mode: mark_step() after every backward and every optimizer step",
        "autogaudi.optimizations.step_marks:StepMarks",
    ),
)

UNIT_NAMES: tuple[str, ...] = tuple(unit.name for unit in UNITS)
