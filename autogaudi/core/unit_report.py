"""What a unit tells the report: ``unit.report``.

Why it is where it is (:meth:`UnitReport.because`), what it measured (``figures``), notes, advice
and the moments it acted, kept on one object the report reads, apart from how the unit patches
(its scope) and what it reads of the run (its run view). Every code is looked up in the unit's
``spec.reasons`` and then the core's (:mod:`autogaudi.core.reasons`), so a typo fails at once.
"""

from __future__ import annotations

from autogaudi.core.reasons import Reason
from autogaudi.measure import numerics


class UnitReport:
    def __init__(self, name: str, reasons: dict, run):
        self._name = name
        self._reasons = reasons
        self._run = run
        self.reason = None  # a Reason: why the unit is where it is now (see because())
        self.figures: dict = {}  # what the unit measured, by name
        self.notes: list = []
        self.recommendations: list = []

    def reason_for(self, code: str, **params) -> Reason:
        """The :class:`Reason` ``code`` names in the unit's table (or the core's), filled in."""
        return Reason(code, self._reasons, **params)

    def because(self, code: str, **params) -> None:
        """Say why the unit is where it is now (the report reads it live)."""
        self.reason = self.reason_for(code, **params)

    def note(self, code: str, **params) -> None:
        """Add a note (a code filled in with ``params``, as :meth:`because`), once however often the
        situation recurs."""
        note = self.reason_for(code, **params)
        if note not in self.notes:
            self.notes.append(note)

    def recommend(self, code: str, do=None, saves=None, saves_basis: str = "estimated", **params) -> None:
        """Something autogaudi measured but will not change for the user, with what to do (a code
        filled in with ``params``); once. ``do``: the exact change (an option, a value, a ``file:line``),
        what the short report shows; ``saves``: the share of a step it could save, ``measured`` or
        ``estimated`` (None: unknown), which ranks it among the next steps."""
        advice = self.reason_for(code, **params)
        if all(item["reason"] != advice for item in self.recommendations):
            self.recommendations.append({"reason": advice, "do": do, "saves": saves, "saves_basis": saves_basis})

    def moment(self, event: str, **params) -> None:
        """A moment the unit acted, for the run's timeline (the report's chart): ``event`` a code,
        ``params`` JSON values."""
        steps = self._run.steps
        steps.timeline.mark(steps.steps, self._name, event, **params)

    def measure_numerics(self, model, args, kwargs, *, of: str, against: str, **how) -> None:
        """The unit's effect on ``model``'s output for one call, measured on a copy
        (:func:`autogaudi.measure.numerics.forward_difference`, ``how`` its variant and reference) into the
        ``numerics_measured`` figure; or a note saying why it was not measured."""
        try:
            difference = numerics.forward_difference(model, args, kwargs, self._run.backend, **how)
        except numerics.NotMeasured as why:
            self.note(f"numerics_not_measured_{why.code}", model=type(model).__name__, **why.params)
            return
        self.figures["numerics_measured"] = numerics.measured(difference, of=of, steps=1, against=against)
