"""A unit's row in the report: its status (:class:`~autogaudi.core.status.Status`), why, its figures and
notes, read live from the unit while it is in force."""

from __future__ import annotations

from autogaudi.core.status import Status


def _said(kind: str, reasons: list) -> dict:
    """A unit's notes or recommendations (``kind``: "note", "recommendation") as the report carries
    them: the texts, and beside them the same as data, as a unit's reason is (codes and values)."""
    return {
        f"{kind}s": [reason.text for reason in reasons],
        f"{kind}_codes": [reason.code for reason in reasons],
        f"{kind}_params": [dict(reason.params) for reason in reasons],
    }


def _advice(advice: dict) -> dict:
    """A recommendation as the report carries it: its text and, as data, its code and values, the
    exact change (``do``) and what it could save."""
    reason = advice["reason"]
    return {
        "what": reason.text,
        "code": reason.code,
        "params": dict(reason.params),
        **{key: advice[key] for key in ("do", "saves", "saves_basis")},
    }


class UnitRow:
    """One unit's line in the report."""

    def __init__(self, name: str, summary: str):
        self.name = name
        self.summary = summary
        self.status = Status.SKIPPED  # APPLIED while the unit is in force: then the unit's own status() is read
        self.reason = None  # a Reason, or None while the unit is in force (its own reason is read live)
        self.unit = None  # the unit object once loaded: its targets, figures and notes are live

    def set(self, status: Status, reason=None) -> None:
        self.status = status
        self.reason = reason

    def as_dict(self) -> dict:
        unit = self.unit
        in_force = unit is not None and self.status is Status.APPLIED
        reason = unit.report.reason if in_force else self.reason
        return {
            "name": self.name,
            "summary": self.summary,
            "status": (unit.status() if in_force else self.status).value,
            "changes": unit.changes_kept() if in_force else [],
            "recommendations": [_advice(advice) for advice in unit.report.recommendations] if unit else [],
            "targets": list(unit.spec.targets) + list(unit.spec.acts_on) if unit else [],
            "reason": reason.text if reason is not None else "",
            "reason_code": reason.code if reason is not None else None,
            "reason_params": dict(reason.params) if reason is not None else {},
            "figures": dict(unit.report.figures) if unit else {},
            **_said("note", unit.report.notes if unit else []),
            # how what the unit did can have made the numbers differ from plain PyTorch's ([]: it cannot),
            # and by how much where the unit measured it (None: not measured; autogaudi.measure.numerics.measured)
            **_numerics(unit if self.status is not Status.SKIPPED else None),
        }


def _numerics(unit) -> dict:
    how = list(unit.numerics_in_run()) if unit is not None else []
    return {"numerics": how, "numerics_measured": unit.report.figures.get("numerics_measured") if how else None}
