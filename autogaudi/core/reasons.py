"""Why a unit is where it is, as data: a stable code for scripts and tests, and the text for people.

Both come from one table: the codes every unit can be given by the core (below) and each unit's own
``reasons`` (``Unit.spec.reasons``). The same table gives the unit's notes and recommendations their codes
(``unit.report.note``, ``unit.report.recommend``): one place to read what a unit can say. The report's JSON carries
``reason_code`` and ``reason_params`` (the values the text was filled in with) beside ``reason``, and
``note_codes``/``note_params`` beside ``notes``, and each of its ``recommendations`` carries its
``code`` and ``params``; the table of every code is generated into docs/reasons.md. Texts may
change; codes are kept.
"""

from __future__ import annotations

# code -> text template ("{name}" filled from the keyword arguments)
CORE = {
    "switched_off": "switched off by {flag} / {env}",
    "not_listed": "not listed in {flag} / {env}",
    "opt_in": "opt-in: switch on with {flag} {unit}",
    "off_by_default": "off by default ({why}): {flag} {choices}",
    "could_not_load": "could not load: {error!r}",
    "needs_unit": "needs the {units} unit, which is not on",
    "other_backend": "applies on {backends} only; this run is on {backend}{why}",
    "old_torch": "needs torch >= {needed}; this is {version}",
    "apply_raised": "apply() raised {error!r}; reverted",
    "failed_at_run_time": "raised {error!r} at run time in {where}; reverted, the run went on without it",
    "model_not_on_device": "stepped aside: the training model is on {device}, not {backend} (seen at the {at}); "
    "this unit acts for {backend} only",
    "not_exact": "off under {flag}: it would change {how}{when}",
    "waiting_for_profile": "waiting for the step profile",
    "no_loader": "no DataLoader built yet",
    "no_budget": "no memory budget known: give --memory-limit GB (on the CPU), or run on an accelerator",
    "no_training_model": "no module owning the optimizer's parameters was called in the profiled step",
    "remembered": "{decision}, as its trial decided in run {run} on {date} ({speedup}x) with the same script, model "
    "and inputs; this run's step time is checked against that trial's",
    "remembered_stopped": "not tried: its trial in run {run} on {date} with the same script, model and inputs was "
    "stopped when its one-off passed {limit} s, the high end of its estimate",
    "changes_numbers": "not tried: it changes the run's numbers ({how}) and would be chosen by timing the run's own "
    "steps, which the machine's load moves, so a seeded run would differ run to run; ask for it with --trial {unit}",
    "one_off_overran": "stopped: its one-off reached {spent} s, past the high end of its estimate ({limit} s); "
    "released, nothing more paid for it",
    # notes of a unit whose effect on the numbers was to be measured on a copy (UnitReport.measure_numerics)
    "numerics_not_measured_memory": "its effect on the numbers not measured: a copy of {model} would take more "
    "than {share:.0%} of the memory free",
    "numerics_not_measured_failed": "its effect on the numbers not measured: a copy of {model} could not run its "
    "forward ({error})",
    # notes of an undo that left something as it found it
    "patch_replaced": "{target} was replaced after autogaudi patched it; left as is",
    "call_slot_replaced": "{model}'s compiled-call slot was replaced after autogaudi set it; left as is",
    "revert_raised": "revert() raised {error!r}",
}


class Reason:
    """One reason: its code and its text, filled in from the template the code names in ``table``
    (a unit's own reasons first, then :data:`CORE`)."""

    __slots__ = ("code", "params", "text")

    def __init__(self, code: str, table: dict = CORE, **params):
        template = table.get(code) or CORE.get(code)
        if template is None:
            raise KeyError(f"no reason code {code!r}; known: {', '.join(sorted({*table, *CORE}))}")
        self.code = code
        self.text = template.format(**params)
        # As JSON values (an exception, a list of shapes: its repr), which also lets go of the objects:
        # an exception kept here would keep its traceback's frames, and the user's tensors in them.
        plain = (str, int, float, bool, type(None))
        self.params = {name: value if isinstance(value, plain) else repr(value) for name, value in params.items()}

    def __str__(self):
        return self.text

    def __eq__(self, other):
        """The same code with the same values: what a note said once is not said again."""
        return isinstance(other, Reason) and (self.code, self.params) == (other.code, other.params)

    __hash__ = None  # params is a dict

    def __repr__(self):
        return f"Reason({self.code!r}: {self.text!r})"
