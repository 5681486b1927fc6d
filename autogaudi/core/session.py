"""One activation of autogaudi in a process, from torch's import until ``disable()`` or exit.

The session picks the backend, starts watching training steps, and walks the registry: each unit
is skipped (switched off by an option, or it does not apply here, with the reason), applied,
failed (its ``apply()`` raised: it is reverted at once), or left waiting for the first event it acts
on (:mod:`autogaudi.core.waiting`), then loaded as at the start. A unit that breaks later, at run time,
is reverted then and the user's run continues. ``stop()`` reverts every applied unit in reverse.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed

from autogaudi import backends
from autogaudi.core.events import Dispatcher, Event
from autogaudi.core.guard import run_guarded
from autogaudi.core.reasons import Reason
from autogaudi.core.registry import PROFILER, UNITS
from autogaudi.core.status import Status
from autogaudi.core.unit import Scope, warn
from autogaudi.core.waiting import WaitingUnit
from autogaudi.entry import before_bridge
from autogaudi.entry.children import gathered as gathered_children
from autogaudi.entry.ranks import gather_from_ranks, is_rank_zero, several_ranks
from autogaudi.measure.trials import StepWindows, TrialRunner
from autogaudi.reporting.rows import UnitRow
from autogaudi.store.cache import inductor_cache_distrust, note
from autogaudi.store.decisions import Memory
from autogaudi.watch.placement import Placement
from autogaudi.watch.steps import TrainingSteps

# What the session itself patches, besides its step watcher's (steps.TARGETS).
TARGETS = ("torch.distributed.destroy_process_group",)


def start_order(units: dict) -> list:
    """The units' names in registry order, each after the units it ``requires`` or declares it
    comes ``after`` (a stable topological sort): a unit started later also hears each event later.
    A cycle is a programming error and raises."""
    order, placing = [], set()

    def place(name):
        if name in order:
            return
        if name in placing:
            raise ValueError(f"units require each other: {name}")
        placing.add(name)
        unit = units[name]
        for needed in (*getattr(unit, "requires", ()), *getattr(unit, "after", ())):
            if needed in units:
                place(needed)
        order.append(name)

    for name in units:
        place(name)
    return order


class Session:
    def __init__(self, options, sources: tuple, decided_before_bridge=None):
        self.options = options
        self._decided_before_bridge = decided_before_bridge  # autogaudi.entry.before_bridge.decide's, if taken
        self.sources = sources
        self.backend = None
        self.events = Dispatcher()
        self.steps = None
        self.trials = None
        self.active = False
        self.applied: list = []  # units in force, in the order they were applied
        self.rows = {info.name: UnitRow(info.name, info.summary) for info in UNITS}
        self.rank_rows = None  # on rank 0 of a multi-rank job: every rank's unit rows, once gathered
        self.rank_step_s = None  # and every rank's step times ({"every", "step_s"}), for the chart
        self._shared_with_ranks = False
        self.core_failure = None  # what switched the session's own watcher off at run time, if anything did
        self._scope = Scope(self)
        self.settled_at_step = None  # the training step after which every decision was made
        self._decisions_seen = None  # the units' statuses and the trials' records when last remembered
        self.cache = None  # the cache folder (autogaudi.store.cache), unless --no-cache or it is not usable
        self.memory = None  # remembered decisions (autogaudi.store.decisions), with the cache
        self.compile_caches: dict = {}  # environment variable -> {"value", "set_by"}
        self.cache_notes: list = []  # autogaudi.store.cache.note()s: why the cache was not used, or not all of it
        self.placement = Placement(self)  # where the training model is (autogaudi.watch.placement)
        self.migration = None  # what gpu_migration decided before the bridge loaded (its module)
        self.step_memory = None  # the step memory watcher (autogaudi.measure.step_memory), where a budget is possible

    def start(self) -> None:
        # before the backend's probe loads the Gaudi bridge, if torch's import has not loaded it already
        self._take_before_bridge(self._decided_before_bridge or before_bridge.decide(self.options))
        self.backend = backends.select(self.options.device)
        if self.cache is not None:
            try:
                self.memory = Memory(self.cache, self.backend, self.options)
            except Exception as error:
                self.cache_notes.append(note("decisions_not_remembered", error=error))
        self.steps = TrainingSteps(self.backend, self.options, self.events, guard=self)
        self.steps.install()
        stop_signals = self.backend.watch_signals(self)
        if stop_signals is not None:
            self._scope.add(stop_signals)
        # The session hears the first backward before any unit (a step mark after it, an extra one before it)
        self.events.rank(self, -1)
        self._scope.add(self.events.on(Event.BEFORE_BACKWARD, self, self.placement.observe_backward).remove)
        if budget_possible(self.options, self.backend):
            from autogaudi.measure.step_memory import StepMemory

            self.step_memory = StepMemory(self)  # before the units: it measures the first step
            self.step_memory.install()
            self._scope.add(self.step_memory.uninstall)
        self.windows = StepWindows(self.steps)  # who measures the steps now: trials, timings, the census
        self.trials = TrialRunner(self.steps, self.events, self.windows)
        self.steps.after_each_step = self._step_over
        if torch.distributed.is_available():
            self._scope.wrap(torch.distributed, "destroy_process_group", self._before_destroy)
        self.active = True
        waiting = {info.name: info for info in UNITS if self._waits(info)}
        units = {info.name: None if info.name in waiting else self._load(info) for info in UNITS}
        for place, name in enumerate(start_order({name: unit and unit.spec for name, unit in units.items()})):
            if name in waiting:
                self.rows[name].set(Status.WATCHING, Reason(waiting[name].waiting))
                self._scope.add(WaitingUnit(self, waiting[name], place).cancel)
            elif units[name] is not None:
                self.events.rank(units[name], place)  # its listeners, however late added, run in this order
                self._start_unit(units[name])
        self.check_settled()

    def _waits(self, info) -> bool:
        """Whether ``info``'s unit is loaded at its first event (:mod:`autogaudi.core.waiting`) rather
        than now. Now where its row must say at once where it stands: under ``--exact`` (whether it may
        act there), named in ``--force`` or ``--trial`` (asked for), or waiting only for a step profile
        that no profiler will make (it needs one)."""
        options = self.options
        return (
            bool(info.waits_for)
            and not options.exact
            and info.name not in (*options.force, *options.trial)
            and self.backend.name in info.backends
            and self.backend.name not in info.starts_at_once_on
            and not options.unit_switched_off(info.name)
            and not (set(info.waits_for) == {Event.STEP_PROFILED.name} and options.unit_switched_off(PROFILER))
        )

    def start_waiting(self, info, place: int):
        """Load and start the unit that waited for the event now under way; the unit (None where it
        could not load). Its row says where it stands, as a unit loaded at the start would."""
        if not self.active:
            return None
        unit = self._load(info)
        if unit is not None:
            self.events.rank(unit, place)
            self._start_unit(unit)
        return unit

    def unit_not_started(self, info, error: Exception) -> None:
        """The wait for ``info``'s unit failed on its own (not the unit's load or start): its row says so."""
        row = self.rows[info.name]
        if row.unit not in self.applied:
            row.set(Status.FAILED, Reason("could_not_load", error=error))

    def _load(self, info):
        """The unit's object, or None (switched off, or it failed to load: its row says so)."""
        row = self.rows[info.name]
        switched_off = self.options.unit_switched_off(info.name)
        if switched_off:
            row.set(Status.SKIPPED, switched_off)
            return None
        if self.backend.name not in info.backends:  # not imported: its code cannot act here
            why = f": {info.why_not_elsewhere}" if info.why_not_elsewhere else ""
            backends = "/".join(info.backends)
            row.set(Status.SKIPPED, Reason("other_backend", backends=backends, backend=self.backend.name, why=why))
            return None
        if info.needs_budget and self.step_memory is None:  # not imported: no budget its code could act on
            row.set(Status.NOT_NEEDED, Reason("no_budget"))
            return None
        try:
            module_name, class_name = info.module.split(":")
            row.unit = getattr(importlib.import_module(module_name), class_name)(self, info)
        except Exception as error:
            row.set(Status.FAILED, Reason("could_not_load", error=error))
            return None
        return row.unit

    def _start_unit(self, unit) -> None:
        row = self.rows[unit.name]
        missing = [name for name in unit.spec.requires if self.unit(name) not in self.applied]
        try:
            reason = Reason("needs_unit", units=", ".join(missing)) if missing else unit.skip_reason()
        except Exception as error:
            row.set(Status.FAILED, Reason("could_not_load", error=error))
            return
        if reason:
            row.set(Status.SKIPPED, reason)
            return
        try:
            unit.apply()
        except Exception as error:
            self._revert(unit)
            row.set(Status.FAILED, Reason("apply_raised", error=error))
            return
        row.set(Status.APPLIED)  # the reason is read live from the unit: it may change as it measures
        self.applied.append(unit)

    def _take_before_bridge(self, decided: dict) -> None:
        """What was decided before the Gaudi bridge loaded (:mod:`autogaudi.entry.before_bridge`): the cache
        folder and the compile caches set for this run (taken back off at its end), and what the
        gpu_migration unit reports."""
        caches = decided["caches"]
        self.cache = caches["cache"]
        self.compile_caches = dict(caches["compile"])
        self.cache_notes.extend(caches["notes"])
        for name, value in caches["set"].items():
            self._scope.add(lambda name=name, value=value: _unset(name, value))
        self.migration = decided["migration"]
        self._check_inductor_cache()

    def work_off_device(self, device: str, at: str) -> None:
        """The training model is on ``device``, not the backend's: every unit that acts for the device
        steps aside (undone as by disable(), its row says ``model_not_on_device``)."""
        reason = Reason("model_not_on_device", device=device, backend=self.backend.device_type, at=at)
        for unit in [unit for unit in self.applied if unit.needs_work_on_device()]:
            self.applied.remove(unit)
            unit.set_aside = True
            try:
                unit.step_aside()
            except Exception as error:
                unit.report.note("revert_raised", error=error)
            self._revert(unit)
            self.rows[unit.name].set(Status.SKIPPED, reason)
            unit.report.moment("stepped_aside")
        self.check_settled()

    def unit_failed_at_run_time(self, unit, error: Exception) -> None:
        if unit not in self.applied:
            return
        self.applied.remove(unit)
        self._revert(unit)
        self.check_settled()
        self.rows[unit.name].set(Status.FAILED, Reason("failed_at_run_time", error=error, where=where_raised(error)))
        unit.report.moment("failed")
        warn(f"{unit.name} raised {error!r}; it is switched off and the run goes on without it")

    # The session as the guard's owner of its own code inside the user's calls (the step watcher's
    # wrappers and hooks): where that raises, every unit is switched off and the watcher goes silent.
    @property
    def in_force(self) -> bool:
        return self.core_failure is None

    def failed_at_run_time(self, error: Exception) -> None:
        if self.core_failure is not None:
            return
        self.core_failure = f"{error!r} in {where_raised(error)}"
        warn(f"autogaudi's step watcher raised {error!r}; every unit is switched off and the run goes on without them")
        for unit in list(self.applied):
            self.unit_failed_at_run_time(unit, error)

    def settled(self) -> bool:
        """Every decision made: the runner has nothing left to run (no trial queued or running, no
        measurement holding the steps) and no unit in force reads ``DECIDING``. From here on
        the run's steps are its steady state; what autogaudi changed stays as it is unless a unit
        fails or a guard switches it off."""
        return self._settled([unit.status() for unit in self.applied])

    def _settled(self, statuses: list) -> bool:
        runner_busy = not self.trials.idle or self.windows.measuring  # the runner has something left to run
        return not runner_busy and Status.DECIDING not in statuses

    def check_settled(self) -> None:
        """Read where the decisions stand: settled from this step where none is open any more; and the
        decisions made so far remembered where they changed. Units never push this: the session reads
        it at the end of every step until settled, and where a unit leaves the run."""
        decisions = [(unit.name, unit.status()) for unit in self.applied]
        if self.settled_at_step is None and self._settled([status for _name, status in decisions]):
            self.settled_at_step = self.steps.steps
        # Written as decisions are made, not only once all are: a run that ends with one still open (a
        # trial waiting for its step) remembers the rest, while its model is alive to be keyed by.
        decisions.append(len(self.trials.records))
        if decisions != self._decisions_seen:
            self._decisions_seen = decisions
            self.remember()

    def _step_over(self) -> None:
        """A training step is over, every listener heard it: a decision made in it counts from here."""
        if self.settled_at_step is None:
            self.check_settled()

    def _check_inductor_cache(self) -> None:
        """Say where torch.compile's own cache (the environment's, or torch's default in the temporary
        folder) could hold another user's code: torch loads compiled code from it."""
        if self.options.no_cache or self.options.cache_trust_shared:
            return
        try:
            found = inductor_cache_distrust(os.environ)
        except Exception:  # a check for the report only: never the run's end
            return
        if found is not None:
            self.cache_notes.append(note("compile_cache_untrusted", **found))

    def remember(self) -> None:
        """Write what this run decided (rank 0), for a later run with the same set-up, model and inputs:
        the step profile and each unit's last trial, except those of units that failed."""
        profile = self.profiler.profile if self.profiler is not None else None
        if self.memory is None or profile is None:
            return
        trials = {
            record["candidate"]: record
            for record in self.trials.records
            if "check" not in record and self.rows[record["candidate"]].status is not Status.FAILED
        }
        for unit in self.applied:  # decisions measured outside the trials (a fused update's timing)
            if (record := unit.measured_decision()) is not None:
                trials[unit.name] = record
        try:
            self.memory.remember(profile, trials)
        except Exception as error:
            self.cache_notes.append(note("decisions_not_written", error=error))

    @property
    def profiler(self):
        """The step profiler where it is in force (its ``profile``, once published, is what the units
        that act on the profile read), else None."""
        profiler = self.rows[PROFILER].unit
        return profiler if profiler is not None and profiler in self.applied else None

    def unit(self, name: str):
        """The live unit called ``name`` (applied or not yet decided), or None."""
        return self.rows[name].unit

    def _revert(self, unit) -> None:
        self.trials.cancel(unit)
        self.windows.release(unit)  # a measurement it held the steps for ends with it
        self.events.forget(unit)  # also done by its revert(), unless an earlier undo raises
        try:
            unit.revert()
        except Exception as error:
            unit.report.note("revert_raised", error=error)

    def stop(self) -> None:
        while self.applied:
            self._revert(self.applied.pop())
        self.steps.uninstall()
        self.steps.timeline.close()
        self._scope.close()
        self.active = False

    def _before_destroy(self, wrapped, instance, args, kwargs):
        group = kwargs.get("group", args[0] if args else None)
        if group is None or group is torch.distributed.group.WORLD:
            self.share_with_ranks()
        return wrapped(*args, **kwargs)

    def share_with_ranks(self) -> None:
        """Every rank posts its unit rows and step times (bounded: :mod:`autogaudi.measure.timeline`); rank 0
        keeps them all for its report. Once, while the default process group (and so its store) is
        still up."""
        if self._shared_with_ranks or not several_ranks():
            return
        self._shared_with_ranks = True
        timeline = self.steps.timeline.as_dict()
        payload = {
            "units": [row.as_dict() for row in self.rows.values()],
            "steps": {"every": timeline["every"], "step_s": timeline["step_s"]},
        }
        try:
            gathered = gather_from_ranks(json.dumps(payload, default=str))
        except Exception as error:  # neither the script's shutdown nor rank 0's own report may break
            warn(f"could not gather the other ranks' unit decisions: {error!r}")
            return
        if gathered is not None:
            posted = {rank: None if text is None else json.loads(text) for rank, text in gathered.items()}
            self.rank_rows = {rank: None if got is None else got["units"] for rank, got in posted.items()}
            self.rank_step_s = {str(rank): None if got is None else got["steps"] for rank, got in posted.items()}

    def report(self, exit_began=None):
        """The run's :class:`~autogaudi.reporting.record.Report`, its module loaded here: a quiet run builds none.
        ``exit_began``: at exit, when :meth:`finish` began (the exit's work up to the report is autogaudi's cost)."""
        from autogaudi.reporting.record import Report

        stats = self.backend.memory_stats()
        watcher = self.step_memory
        if watcher is None:
            from autogaudi.measure.step_memory import StepMemory

            watcher = StepMemory(self)  # never installed: it reports what a watcher with no budget does
        memory = {**(stats.as_dict() if stats else {}), **watcher.report()}
        # the exit so far (the units' run ending, decisions remembered, the report's modules and figures)
        exit_s = time.perf_counter() - exit_began if exit_began is not None else 0.0
        return Report(
            torch_version=torch.__version__,
            enabled_by=self.sources,
            active=self.active,
            backend={**self.backend.describe(), "placement": self.placement.as_dict(), **self._migration_facts()},
            options=self.options.as_dict(),
            steps={**self.steps.figures(), "decisions_settled_at_step": self.settled_at_step},
            memory=memory,
            units=[row.as_dict() for row in self.rows.values()],
            trials=list(self.trials.records),
            ranks=self.rank_rows,
            children=gathered_children(),
            cache=self._cache_facts(),
            timeline={**self.steps.timeline.as_dict(), "ranks": self.rank_step_s, "exit_s": round(exit_s, 4)},
        )

    def _migration_facts(self) -> dict:
        """The gpu_migration unit's facts for the report's first line, where it has any."""
        unit = self.unit("gpu_migration")
        facts = unit.facts() if unit is not None and hasattr(unit, "facts") else None
        return {"migration": facts} if facts else {}

    def _cache_facts(self):
        notes = self.cache_notes + (self.cache.notes if self.cache is not None else [])
        notes += self.memory.notes if self.memory is not None else []
        said = {"notes": [str(n) for n in notes], "note_codes": [n.code for n in notes]}
        said["note_params"] = [n.params for n in notes]
        if self.cache is None:
            return (
                None if self.options.no_cache else {"dir": None, "decisions": "not remembered", "compile": {}, **said}
            )
        memory = self.memory
        if memory is None or memory.script is None:
            decisions = "not remembered (no script file)" if memory is not None else "not remembered"
        elif memory.recalled is not None:
            decisions = (
                f"taken from the {memory.recalled['runs']} earlier run(s) with this script, model and inputs "
                f"(the last on {memory.recalled['last_run_on']}), where they apply"
            )
        else:
            decisions = "measured in this run"
        return {"dir": self.cache.root, "decisions": decisions, "compile": dict(self.compile_caches), **said}

    def finish(self, explicit: bool) -> None:
        """At exit: print and write the report, on rank 0, if autogaudi was asked for or trained."""
        began = time.perf_counter()
        self.share_with_ranks()
        ended_by = getattr(sys, "last_value", None)  # python's (and the launcher's) uncaught exception
        for unit in list(self.applied):
            run_guarded(unit, unit.run_ending, ended_by)
        self.remember()
        if self.cache is not None and self.steps.trained and is_rank_zero() and compile_caches_written():
            try:  # not in every DataLoader or compile worker: they compiled and decided nothing
                self.cache.evict()  # the compile caches grew during the run
            except Exception as error:
                self.cache_notes.append(note("not_evicted", error=error))
        if not (explicit or self.steps.trained) or not is_rank_zero():
            return
        if self.options.quiet and not self.options.report:  # nobody reads it: not built
            return
        report = self.report(exit_began=began)
        not_written = None
        if self.options.report:
            from autogaudi.reporting import output_file as report_file  # here: loaded only for a report

            try:
                if self.options.report.lower().endswith(".html"):
                    from autogaudi.reporting.page import render  # here: the page's module is loaded only for a page

                    report_file.write(self.options.report, render(report))
                else:
                    report_file.write(self.options.report, report.to_json())
            except Exception as error:  # a full disk, a folder gone: the short report still arrives
                not_written = f"autogaudi: the report file {self.options.report} was not written: {error!r}\n"
        if not self.options.quiet or not_written:
            sys.stderr.write(report.format() + (not_written or ""))
            sys.stderr.flush()


def compile_caches_written() -> bool:
    """Whether a compiler may have written into the cache's compile folders in this run: inductor's
    on-disk cache was loaded (torch.compile compiled), or the Gaudi bridge (its recipe cache). Only
    then is the cache evicted at exit: autogaudi's own writes evict as they write, and walking a
    cache of thousands of files would cost every short run that compiled nothing."""
    return "torch._inductor.codecache" in sys.modules or before_bridge.BRIDGE in sys.modules


def budget_possible(options, backend) -> bool:
    """Whether a step can have a memory budget (``--memory-limit``, or an accelerator's capacity): where
    not (the CPU without a limit), neither the step memory watcher nor a unit that needs one is loaded."""
    return backend.name != "cpu" or bool(options.memory_limit)


def where_raised(error: BaseException) -> str:
    """The innermost line of autogaudi's own code in ``error``'s traceback (``file:line in function``)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package, not core/
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename.startswith(package)]
    if not frames:
        return "autogaudi"
    frame = frames[-1]
    return f"{os.path.relpath(frame.filename, os.path.dirname(package))}:{frame.lineno} in {frame.name}"


def _unset(name: str, value: str) -> None:
    """Take an environment variable autogaudi set back off, unless something changed it since."""
    if os.environ.get(name) == value:
        del os.environ[name]
