"""Every optimization unit autogaudi knows, as data, in the order they are applied.

The registry names each unit and says in one line what it does; the unit's module (imported only
once torch is imported) says what it patches, when it applies, and how it is undone. Keeping the
list here, free of torch imports, lets option validation and ``--help`` run before torch loads.
"""
from __future__ import annotations


class UnitInfo:
    """A unit's name, one-line summary and ``"package.module:Class"``; a plain class, not a
    NamedTuple, because importing ``typing`` would cost every ``AUTOGAUDI=1`` process ~8 ms."""

    __slots__ = ("name", "summary", "module")

    def __init__(self, name: str, summary: str, module: str):
        self.name = name
        self.summary = summary
        self.module = module


UNITS: tuple[UnitInfo, ...] = (
    UnitInfo(
        "step_marks",
        "HPU lazy mode: mark_step() after every backward and every optimizer step",
        "autogaudi.optimizations.step_marks:StepMarks",
    ),
)

UNIT_NAMES: tuple[str, ...] = tuple(unit.name for unit in UNITS)
