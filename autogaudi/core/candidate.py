"""One lifecycle for what a unit may or may not keep: a candidate (capture, a memory format, a
precision) set up into a scope of its own, decided by a trial or by a remembered decision checked
on this run, switched, and released exactly.

Why one: the units that decide at run time each wrote this sequence by hand, their state being
whichever attributes happened to be None, and a release that forgot one field kept a model alive or
left a switch on. Here the state is explicit (:class:`State`), everything the candidate set up lives
in one child scope of the unit (closed on release, on revert and on failure alike), and the report
reads the unit's status and what is in use from that state. A unit supplies only its
refusals, ``set_up(scope)`` (what it builds, into the scope, returning nothing or its figures) and
``switch(on)``; a unit that checks before it tries (a guard) says so through :meth:`Candidate.checking`.
A trial that would change the run's numbers runs only where the user asks for it (:meth:`Candidate.untried`).
"""

from __future__ import annotations

import enum

from autogaudi.core.reasons import CORE
from autogaudi.core.registry import SWITCHED_ON_BY
from autogaudi.core.status import Status
from autogaudi.core.unit import NUMERICS, ActsOnProfile
from autogaudi.measure.trials import WARMUP, Check, Trial, materiality_of
from autogaudi.store.decisions import origin


def untried_reason(unit):
    """Why ``unit`` may not choose by a timing of the run's own steps, as a Reason, or None where it
    may: it changes the numbers and the user did not ask for it (``--trial``, or the unit's own option
    switching it on). A timing moves with the machine's load and the cache's state, so under the
    defaults a choice that changes the numbers is never taken on one: a seeded run gives the same
    numbers run after run."""
    numerics = unit.numerics_on(unit.run.backend)
    if not numerics or unit.name in unit.run.options.trial or unit.name in SWITCHED_ON_BY:
        return None
    how = " and ".join(NUMERICS[effect] for effect in numerics)
    return unit.report.reason_for("changes_numbers", how=how, unit=unit.name)


class State(enum.Enum):
    WAITING = "waiting"  # for what it acts on (the step profile; a loader's in-process window): nothing set up
    CHECKING = "checking"  # set up, checked by the unit before it may switch on (a guard)
    TRIAL = "trial"  # set up, switched between steps by a trial (a loader's workers: timed against its window)
    FOLLOWING = "following"  # a remembered decision followed while this run's check of it runs
    ON = "on"  # kept: on for the rest of the run
    RELEASED = "released"  # not kept, or no longer: everything it set up undone
    REFUSED = "refused"  # not for this run (the unit's refusal); nothing set up
    FAILED = "failed"  # the unit failed at run time: everything it set up undone


UNDECIDED = (State.WAITING, State.CHECKING, State.TRIAL, State.FOLLOWING)

# The reason codes the candidate gives through its unit, by moment; a unit may rename them.
CODES = {
    "forced": "switched_on",  # on without a trial: --force
    "no_trials": "switched_on",  # on without a trial: --no-trials, or the unit needs none
    "trial": "trial_running",
    "kept": "measured_faster",
    "rejected": "rejected",
}


class Candidate:
    """The lifecycle of one unit's candidate. ``set_up(scope)`` builds it (returns None or figures;
    ``set_up_s`` among them is the trial's set-up cost); ``switch(on)`` flips it (called only on
    a change); ``kept(scope)``, where given, runs once it is kept: what only a kept candidate does,
    into a scope closed again where a trial decides it anew;
    ``decided(keep, record)`` adds a unit's figures from a trial's record; ``params()`` fills in the
    reasons; ``try_again()`` is what runs when a remembered decision's check differs (default:
    a trial)."""

    def __init__(self, unit, set_up, switch, params, codes=None, kept=None, decided=None, try_again=None):
        self.unit = unit
        self._set_up = set_up
        self._switch = switch
        self._kept = kept
        self._decided = decided
        self.params = params
        self.codes = {**CODES, **(codes or {})}
        self.try_again = try_again or self.try_
        self.needs_trial = True  # False: on without a trial (a precision asked for by name)
        self.state = State.WAITING
        self.on = False
        self.profile = None  # the step profile it was set up on (it holds the model weakly)
        self.model = self.optimizer = None  # held while set up, released with the scope
        self.scope = None
        self._kept_scope = None
        self.set_up_figures: dict = {}

    @property
    def undecided(self) -> bool:
        return self.state in UNDECIDED

    def refuse(self, reason) -> None:
        """Not for this run (a :class:`~autogaudi.core.reasons.Reason`); nothing is set up."""
        self.state = State.REFUSED
        self.unit.report.reason = reason

    def untried(self) -> bool:
        """Refuse a trial that would change the run's numbers (True) unless the user asked for it:
        :func:`untried_reason`."""
        reason = untried_reason(self.unit)
        if reason is not None:
            self.refuse(reason)
        return reason is not None

    def set_up(self, profile) -> dict:
        """Set the candidate up on ``profile``'s model, once, into a child scope of the unit."""
        if self.scope is None:
            self.profile = profile
            self.model, self.optimizer = profile.model, profile.optimizer
            self.scope = self.unit.scope.child()
            self.scope.add(self._undone)  # the first undo: it runs last, after all the set-up's
            self.set_up_figures = self._set_up(self.scope) or {}
        return self.set_up_figures

    def checking(self) -> None:
        """Set up, and checked by the unit before it may switch on: it calls :meth:`try_`,
        :meth:`follow` or :meth:`release` when its check decided."""
        self.state = State.CHECKING

    def try_(self, profile=None, **trial) -> None:
        """Set up (where not yet) and switch on: at once where ``--force``d, with ``--no-trials``
        or where no trial is needed, else through a trial (``trial``: :class:`Trial`'s
        ``one_off_limit_s``)."""
        unit = self.unit
        forced = unit.name in unit.run.options.force
        untrialled = forced or unit.run.options.no_trials or not self.needs_trial
        if not untrialled and self.untried():
            return
        self.set_up(profile or self.profile)
        if untrialled:
            self._set_up_figures_reported()
            self._keep()
            self._because("forced" if forced else "no_trials")
            return
        set_up_s = self.set_up_figures.get("set_up_s", 0.0)
        self._unkeep()  # a remembered keep tried again: both arms start from the set-up alone
        self.state = State.TRIAL
        materiality = materiality_of(unit)  # a candidate that changes the numbers must save its share
        trial = Trial(unit, unit.name, self.switch, self._trial_decided, set_up_s, materiality=materiality, **trial)
        unit.run.trials.submit(trial)
        self._because("trial")

    def follow(self, record: dict, profile=None) -> None:
        """Take a remembered trial's decision without the trial. A rejection (or a trial stopped for
        its one-off) holds: nothing is set up, and no later step starts that trial again. A keep is
        set up and on, then this run's steps are checked against the time that trial measured with
        it; only where they clearly contradict it, :attr:`try_again`."""
        keep = record["decision"] == "kept"
        unit = self.unit
        self.profile = profile or self.profile
        unit.report.figures["remembered_from_run"] = record["run"]
        if record["decision"] == "stopped":
            unit.report.because("remembered_stopped", limit=record["one_off_limit_s"], **origin(record))
            self.release()
            return
        unit.report.figures["speedup"] = record["speedup"]
        unit.report.because("remembered", decision=record["decision"], speedup=record["speedup"], **origin(record))
        if not keep:
            self.release()
            return
        if self.untried():  # a keep a run under the defaults would not have tried: plain's numbers
            return
        self.set_up(profile or self.profile)
        self._set_up_figures_reported()
        self._keep()
        self.state = State.FOLLOWING

        def checked(matches: bool, check: dict) -> None:
            unit.report.figures["remembered_check"] = check["decision"]
            if not matches:
                self.try_again()
            elif self.state is State.FOLLOWING:
                self.state = State.ON

        expected_s = record["ms_per_step_with"] / 1000
        load_then = record.get("load", 1.0)
        unit.run.trials.submit(Check(unit, unit.name, expected_s, checked, warmup=WARMUP, load_then=load_then))

    def release(self, code: str | None = None, **params) -> None:
        """Not kept (or no longer): switch off and undo everything set up; ``code``: the reason."""
        if code is not None:
            self.unit.report.because(code, **params)
        self._close()
        self.state = State.RELEASED

    def _set_up_figures_reported(self) -> None:
        """On without a trial: the set-up's figures go to the report (a trial's record brings them)."""
        self.unit.report.figures.update({name: round(value, 3) for name, value in self.set_up_figures.items()})

    def _because(self, moment: str) -> None:
        """The unit's code for ``moment``, filled in with the parameters its text names."""
        code = self.codes[moment]
        template = self.unit.spec.reasons.get(code) or CORE[code]
        self.unit.report.because(
            code, **{name: value for name, value in self.params().items() if "{" + name in template}
        )

    def switch(self, on: bool) -> None:
        if on != self.on:
            self.on = on
            self._switch(on)

    def _keep(self) -> None:
        self.switch(True)
        self.state = State.ON
        if self._kept is not None and self._kept_scope is None:
            self._kept_scope = self.scope.child()
            self._kept(self._kept_scope)

    def _unkeep(self) -> None:
        scope, self._kept_scope = self._kept_scope, None
        if scope is not None:
            scope.close()

    def _trial_decided(self, keep: bool, record: dict) -> None:
        unit = self.unit
        if record["decision"] == "stopped":
            self.release("one_off_overran", spent=record["one_off_s"], limit=record["one_off_limit_s"])
            return
        unit.report.figures["speedup"] = record["speedup"]
        if self._decided is not None:
            self._decided(keep, record)
        self._because("kept" if keep else "rejected")
        if keep:
            self._keep()
        else:
            self._close()
            self.state = State.RELEASED

    def _close(self) -> None:
        self.switch(False)
        scope, self.scope = self.scope, None
        if scope is not None:
            scope.close()

    def _undone(self) -> None:
        """The scope's last undo (release, revert or failure alike): off, and nothing held."""
        self.switch(False)
        self.scope = self._kept_scope = None
        self.model = self.optimizer = None
        self.set_up_figures = {}
        if self.undecided or self.state is State.ON:
            self.state = State.FAILED if self.unit.failure is not None else State.RELEASED


class DecidesCandidate(ActsOnProfile):
    """Base of the units whose decision is a :class:`Candidate` (``self.candidate``, made in
    ``apply``): the report's states read from it."""

    def decision(self) -> Status:
        state = self.candidate.state
        if state is State.WAITING:
            return Status.WATCHING
        return Status.DECIDING if state in UNDECIDED else Status.NOT_NEEDED

    def in_use(self) -> bool:
        """Switched on: kept, followed, or in a trial's "with" arm."""
        return self.candidate.on and self.candidate.model is not None
