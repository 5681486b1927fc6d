"""What every optimization unit is: one spec, a scope to patch through, a report to speak to, a run to read.

A unit never hand-rolls attribute swaps or hands torch a callable of its own: it patches through
its scope (``unit.scope``, a :class:`UnitScope`): ``wrap`` (a wrapt ``FunctionWrapper``), ``hook``,
``on`` (the run's events) and ``hold`` (a layer of the model's one call route,
:mod:`autogaudi.watch.model_call`). Each records how to undo itself, so :meth:`Unit.revert`
restores every attribute to the very object it was (identity, not equality), in reverse order, and
each runs the unit's code through the core's guard (:mod:`autogaudi.core.guard`): when it raises, the unit
is reverted and reported as failed while the user's call completes as plain PyTorch's would; the
user's own exceptions propagate unchanged. What the unit declares is its :class:`UnitSpec`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import re
import sys
import types

import torch
import wrapt

from autogaudi.core.events import Event
from autogaudi.core.guard import guarded, guarded_method_call
from autogaudi.core.options import OPTIONS_BY_NAME
from autogaudi.core.reasons import Reason
from autogaudi.core.registry import PROFILER
from autogaudi.core.run_view import RunView
from autogaudi.core.status import Status
from autogaudi.core.unit_report import UnitReport

# The call-route layers (a module held by a unit): loaded at a unit's first hold, not at every start
model_call = wrapt.lazy_import("autogaudi.watch.model_call")

# How a unit can make a run's numbers differ from plain PyTorch's on the same machine (losses,
# parameters, gradients, random draws; docs/numerics.md), as the report and --exact's reason say it.
ROUNDING, RANDOM, PRECISION, DATA, FORMULA = "rounding", "random", "precision", "data", "formula"
NUMERICS = {
    ROUNDING: "rounding (the same maths, summed or fused in another order)",
    FORMULA: "formula (a kernel whose update rule differs from torch's; its bound in docs/numerics.md)",
    RANDOM: "random draws (other dropout masks or samples, from the same distributions)",
    PRECISION: "precision (lower-precision arithmetic)",
    DATA: "the batches (samples repeated or dropped)",
}


class _BoundWrapper(wrapt.BoundFunctionWrapper):
    """A wrapped method bound to an instance whose ``__func__`` is the wrapper, not the original: code
    that rebinds a method through ``__func__`` (torch's LR schedulers wrap ``optimizer.step`` so)
    would otherwise call the original and step around the unit."""

    @property
    def __func__(self):
        return self._self_parent


class _MethodWrapper(wrapt.FunctionWrapper):
    __bound_function_wrapper__ = _BoundWrapper


def wrap_attribute(owner, attribute: str, wrapper):
    """Replace ``owner.attribute`` by a wrapt wrapper; return a function that puts it back.

    ``wrapper(wrapped, instance, args, kwargs)`` follows wrapt's convention (a :class:`Scope` hands
    it through the guard first). The undo restores the
    original object only while the attribute is still our wrapper: if somebody wrapped it again
    after us, unwrapping would drop their patch, so it is left alone and the undo says so.
    """
    namespace = vars(owner)
    owned = attribute in namespace
    original = namespace[attribute] if owned else getattr(owner, attribute)
    patched = _MethodWrapper(original, wrapper)
    setattr(owner, attribute, patched)

    def undo():
        if vars(owner).get(attribute) is not patched:
            return Reason("patch_replaced", target=_dotted(owner, attribute))
        if owned:
            setattr(owner, attribute, original)
        else:
            delattr(owner, attribute)
        return None

    return undo


class Scope:
    """Undo actions kept in one place and run newest first by :meth:`close`: everything a unit (or
    one arm of a trial) patched, hooked or set, in the spirit of torch's ``RemovableHandle``. An undo
    may return a note (why it left something as it was). Whatever runs inside the user's calls is
    registered through the scope's ``guard``, the owner that fails if it raises
    (:mod:`autogaudi.core.guard`)."""

    def __init__(self, guard):
        self._undo: list = []
        self.guard = guard

    def add(self, undo) -> None:
        self._undo.append(undo)

    def wrap(self, owner, attribute: str, wrapper) -> None:
        """Wrap ``owner.attribute`` with ``wrapper(wrapped, instance, args, kwargs)``, guarded."""
        self.add(wrap_attribute(owner, attribute, functools.partial(guarded_method_call, self.guard, wrapper)))

    def hook(self, register, fn, *args, **kwargs):
        """``register(guarded fn, *args, **kwargs)`` (a torch ``register_*hook``), removed on close;
        a hook that raises changes nothing and fails the guard's owner. Returns the handle."""
        handle = register(guarded(self.guard, fn), *args, **kwargs)
        self.add(handle.remove)
        return handle

    def hold(self, model, layer, around) -> None:
        """Hold ``layer`` of ``model``'s call route with ``around(call, args, kwargs)``, guarded."""
        self.add(model_call.hold(self.guard, model, layer, around))

    def child(self) -> Scope:
        """A scope closed on its own (a trial's candidate) or, at the latest, with this one."""
        scope = Scope(self.guard)
        self.add(scope.close)
        return scope

    def close(self):
        """Undo everything, newest first; the notes of the undos that left something as it was."""
        notes = []
        while self._undo:
            note = self._undo.pop()()
            if note:
                notes.extend(note if isinstance(note, list) else [note])
        return notes or None


class UnitScope(Scope):
    """A unit's scope: a :class:`Scope` that also listens to the run's events for its unit, and whose
    undos' notes join the unit's report when it closes. Child scopes (a trial's candidate, a wait)
    are unit scopes too, so a unit patches, hooks and listens through one object whatever it scopes."""

    def __init__(self, unit, events, notes: list):
        super().__init__(unit)
        self._events = events
        self._notes = notes

    def on(self, event: Event, listener):
        """Call ``listener`` at every ``event`` while the unit is in force and this scope is open; a
        listener that raises reverts the unit. Returns the handle (a listener may remove itself)."""
        handle = self._events.on(event, self.guard, listener)
        self.add(handle.remove)
        return handle

    def child(self) -> UnitScope:
        scope = UnitScope(self.guard, self._events, self._notes)
        self.add(scope.close)
        return scope

    def close(self) -> None:
        """Undo everything, newest first; the undos' notes go to the unit's report."""
        self._notes.extend(super().close() or ())


def torch_version() -> tuple:
    """(major, minor) of the running torch, e.g. (2, 13) for "2.13.0+cpu"."""
    return tuple(int(part) for part in re.findall(r"\d+", torch.__version__)[:2])


def _dotted(owner, attribute: str) -> str:
    prefix = getattr(owner, "__module__", None) if isinstance(owner, type) else None
    name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
    return ".".join(part for part in (prefix, name, attribute) if part)


# The fields of a :class:`UnitSpec`, in order, with their defaults. A named tuple, not a frozen
# dataclass: it is built at every start, and a dataclass's generated methods cost several times more.
_SPEC_FIELDS = {
    # the dotted ``owner.attribute`` paths the unit itself patches: each is wrapped while the unit is
    # on where it applies and the very original object after revert (tests/test_contract.py)
    "targets": (),
    # what it changes on the user's own objects or through the session's step watcher, in words
    "acts_on": (),
    "requires": (),  # units that must be in force for this one to apply; the session starts them first
    # units that, where they are on, start (and so hear each event) before this one; not required
    "after": (),
    "min_torch": (2, 4),  # the oldest torch whose APIs the unit relies on
    # (figure, text): the figure that counts what the unit changed in the run, and how the report's
    # headline says it ("{}" is the count). Units that only measure leave it empty.
    "changed_figure": (),
    # code -> text template of why the unit is where it is (autogaudi/core/reasons.py); the core's on top.
    # Read-only: a subclass gives its own dict (``{**Base.spec.reasons, ...}``).
    "reasons": types.MappingProxyType({}),
    # How the unit can change the run's numbers (keys of NUMERICS); () leaves them bitwise plain
    # PyTorch's, which the generated test tests/test_exact.py checks. Only () units run under --exact.
    "numerics": (),
    "exact_when": "",  # where numerics is not (): when they still come out identical, in words
    # The states the unit can be in, for the generated contract test (tests/test_contract_matrix.py):
    # in force before it acts, in use once the run is profiled and decided, failed at run time, and
    # after disable(). Units that decide through trials or checks add theirs.
    "states": ("watching", "in_use", "failed", "disabled"),
    # Whether the unit only makes sense where the training model is on the backend's device (step
    # marks, device kernels, pinning for a copy): it steps aside where the work is on the host
    # (:mod:`autogaudi.watch.placement`, reason ``model_not_on_device``).
    "acts_for_device": False,
}


class UnitSpec(collections.namedtuple("UnitSpec", tuple(_SPEC_FIELDS), defaults=tuple(_SPEC_FIELDS.values()))):
    """What a unit declares about itself, read by the session, the report and the generated contract
    tests before the unit acts: one value, so a subclass states what differs (``Base.spec.but(...)``)."""

    __slots__ = ()

    def but(self, **changes) -> UnitSpec:
        """This spec with ``changes``: a subclass's own declarations over its base's."""
        return self._replace(**changes)


class Unit:
    """Base class of an optimization unit; one subclass per module in ``autogaudi.optimizations``.

    Subclasses declare a ``spec`` (:class:`UnitSpec`), may refine :meth:`skip_reason`, and implement
    :meth:`apply`, working through what the unit holds: ``self.scope`` (what it hands torch),
    ``self.report`` (what it tells the report: :mod:`autogaudi.core.unit_report`) and ``self.run`` (what
    it reads of the run: :mod:`autogaudi.core.run_view`). The unit holds them rather than receiving them
    in ``apply``: its hooks and listeners run long after ``apply`` returns and need the same three.
    """

    spec = UnitSpec()

    def __init__(self, session, info):
        self._session = session  # only to report a failure to: the unit reads the run through self.run
        self.name = info.name
        self.summary = info.summary
        # where it can apply, and why the other backends do not need it: the registry's, which the
        # session reads before it imports a unit
        self.backends, self.why_not_elsewhere = info.backends, info.why_not_elsewhere
        self.run = RunView(session)
        self.report = UnitReport(self.name, self.spec.reasons, self.run)
        self.failure = None  # what switched the unit off at run time (a repr: no traceback kept alive)
        self.set_aside = False  # stepped aside: the work is not on the backend's device
        self.scope = UnitScope(self, session.events, self.report.notes)

    def skip_reason(self):
        """Why this unit does not apply to this run (a :class:`Reason`), or None when it does."""
        if self.run.backend.name not in self.backends:
            why = f": {self.why_not_elsewhere}" if self.why_not_elsewhere else ""
            return self.report.reason_for(
                "other_backend", backends="/".join(self.backends), backend=self.run.backend.name, why=why
            )
        if torch_version() < self.spec.min_torch:
            return self.report.reason_for(
                "old_torch", needed=".".join(map(str, self.spec.min_torch)), version=torch.__version__
            )
        numerics = self.numerics_on(self.run.backend)
        if self.run.options.exact and numerics:
            return self.report.reason_for(
                "not_exact",
                flag=OPTIONS_BY_NAME["exact"].flag,
                how=" and ".join(NUMERICS[effect] for effect in numerics),
                when=f"; identical only where {self.spec.exact_when}" if self.spec.exact_when else "",
            )
        return None

    @classmethod
    def numerics_on(cls, backend) -> tuple:
        """``numerics`` on ``backend`` (a :class:`~autogaudi.backends.base.Backend`); a unit whose
        effect differs by backend says so here."""
        return cls.spec.numerics

    def numerics_in_run(self) -> tuple:
        """How what this unit did in this run can have changed the numbers: its ``numerics`` where it
        changed something (:meth:`changes`) or a trial ran it, else ()."""
        acted = self.changes() or any(record["candidate"] == self.name for record in self.run.trials.records)
        return self.numerics_on(self.run.backend) if acted else ()

    def apply(self) -> None:
        raise NotImplementedError

    def needs_work_on_device(self) -> bool:
        """Whether this unit steps aside where the training model is not on the backend's device
        (``acts_for_device``; a unit whose path differs by backend refines it)."""
        return self.spec.acts_for_device

    def step_aside(self) -> None:
        """The work turned out to be on the host: undo, beyond :meth:`revert`, what the unit did to
        objects built before that was known (a loader pinned at construction). Reverted after this."""

    def changes(self) -> list:
        """What this unit changed in the run, for the report's headline; [] where nothing changed."""
        figure, text = self.spec.changed_figure or (None, "")
        count = self.report.figures.get(figure) if figure else None
        return [text.format(count)] if count else []

    def changes_kept(self) -> list:
        """:meth:`changes`, except while a trial runs this unit: a candidate on trial is on in some
        steps only, and nothing is changed until it is kept."""
        return [] if self.run.trials.trying(self) else self.changes()

    def decision(self) -> Status:
        """Where this unit's decision stands while it is in force, as the measurement runner
        (:mod:`autogaudi.measure.trials`) has it: ``DECIDING`` while a trial or measurement of it has something
        left to run, ``NOT_NEEDED`` once its measurements are all done (nothing it changed is kept),
        else ``WATCHING`` (waiting for what it acts on). Units say it through the runner, never here."""
        runner = self.run.trials
        if runner.pending(self):
            return Status.DECIDING
        return Status.NOT_NEEDED if runner.decided(self) else Status.WATCHING

    def status(self) -> Status:
        """Where the unit stands, one value for the report and for the session's ``settled()``: a
        decision under way comes first (a fused optimizer still timed is deciding, not applied), then
        what it changed and keeps, then its :meth:`decision`."""
        if self.failure is not None:
            return Status.FAILED
        if self.set_aside:
            return Status.SKIPPED
        decision = self.decision()
        if decision is not Status.DECIDING and self.changes_kept():
            return Status.APPLIED
        return decision

    def revert(self) -> None:
        self.scope.close()

    @property
    def in_force(self) -> bool:
        """False once the unit failed at run time or stepped aside: its guarded code is skipped from then on."""
        return self.failure is None and not self.set_aside

    def failed_at_run_time(self, error: Exception) -> None:
        """The guard's report of an exception from this unit's own code: switch the unit off."""
        if self.failure is None:
            self.failure = repr(error)
            self._session.unit_failed_at_run_time(self, error)

    def run_ending(self, error) -> None:
        """The run ends (at exit, before the report), with the exception raised through the script
        (None where none was): for a unit that leaves the next run a decision about it."""

    @contextlib.contextmanager
    def fail_open(self):
        """Run unit code; if it raises, revert the unit, report it failed, and carry on."""
        try:
            yield
        except Exception as error:
            self.failed_at_run_time(error)

    def measured_decision(self):
        """A decision this unit measured outside the trial runner (a record in a trial's remembered
        form, ``decision`` and the times), for a later run with the same set-up to follow at the same
        step; None where it has none. The trials' own records are remembered by the session."""
        return None


class ActsOnProfile(Unit):
    """Base of the units that act once the step is profiled (on the training model it finds) and
    switch on at once or through a trial (:mod:`autogaudi.core.candidate`)."""

    spec = UnitSpec(
        requires=(PROFILER,), states=("watching", "in_use", "trial", "kept", "rejected", "failed", "disabled")
    )

    def decision(self) -> Status:
        if self.run.trials.pending(self):
            return Status.DECIDING
        return Status.WATCHING if self.run.profiler.profile is None else Status.NOT_NEEDED

    def trial_speedup(self) -> str:
        """The report headline's clause for the ``speedup`` figure and the trial it comes from (this
        run's, or the run it was remembered from); empty where no trial measured one."""
        if "speedup" not in self.report.figures:
            return ""
        run = self.report.figures.get("remembered_from_run")
        trial = f"run {run}'s trial" if run else "its trial"
        return f", {self.report.figures['speedup']}x per step in {trial}"


def warn(message: str) -> None:
    sys.stderr.write(f"autogaudi: {message}\n")
