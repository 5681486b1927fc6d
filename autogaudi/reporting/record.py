"""What autogaudi did in this process: per unit its status (:class:`~autogaudi.core.status.Status`), why,
and the figures.

At exit (rank 0 only) a short report goes to stderr: what changed and what it did to this run's
steps, what the run gained or paid against plain PyTorch in all, and what to try next; ``--verbose``
adds every unit's row. The JSON (``--report PATH``) and the page (``--report run.html``,
:mod:`autogaudi.reporting.page`) carry all of it, so a person and a script read the same facts. The rows are
:mod:`autogaudi.reporting.rows`', the figures' noise and the whole run :mod:`autogaudi.reporting.effects`',
the lines :mod:`autogaudi.reporting.text`'s.
"""

from __future__ import annotations

import json

from autogaudi._version import __version__
from autogaudi.core.registry import PROFILER
from autogaudi.reporting.effects import effect, effect_of_batches, effect_of_part, spread, trial_cost_s, whole_run
from autogaudi.reporting.rows import UnitRow
from autogaudi.reporting.text import (
    block,
    format_cache,
    format_child,
    format_children,
    format_effect,
    format_memory,
    format_next,
    format_ranks,
    format_results,
    format_run,
    format_speedup,
    format_steps,
    format_trial,
    where_lines,
)

__all__ = ["Report", "UnitRow"]

# The JSON report's layout: 2 since units that changed nothing read watching / not needed; 3 since
# recommendations are {what, do, saves} and the report carries a summary and a timeline; 4 since a
# unit measuring or checking what changes the steps reads deciding.
SCHEMA = 4
NEXT_STEPS = 3  # the most useful recommendations the short report lists


class Report:
    def __init__(
        self,
        *,
        torch_version,
        enabled_by,
        active,
        backend,
        options,
        steps,
        memory,
        units,
        trials=(),
        ranks=None,
        children=None,
        cache=None,
        timeline=None,
    ):
        self.torch_version = torch_version
        self.enabled_by = enabled_by
        self.active = active
        self.backend = backend
        self.options = options
        self.steps = steps
        self.memory = memory
        self.units = units
        self.trials = list(trials)  # every A/B trial run: candidate, medians, one-off cost, decision
        self.ranks = ranks  # multi-rank jobs, on rank 0: {rank: that rank's unit rows, or None if it never answered}
        self.children = children  # the parts child processes wrote (autogaudi.entry.children), or None
        self.cache = cache  # the cache folder, what this run took from it and what it set, or None (--no-cache)
        self.timeline = timeline  # each step's seconds and the moments autogaudi acted (autogaudi.measure.timeline)

    @classmethod
    def not_started(cls, options) -> Report:
        return cls(
            torch_version=None,
            enabled_by=[],
            active=False,
            backend=None,
            options=options.as_dict() if options is not None else None,
            steps={},
            memory=None,
            units=[],
        )

    def unit(self, name: str) -> dict:
        return next(row for row in self.units if row["name"] == name)

    def as_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "autogaudi": __version__,
            "torch": self.torch_version,
            "enabled_by": list(self.enabled_by),
            "active": self.active,
            "backend": self.backend,
            "options": self.options,
            "steps": self.steps,
            "memory": self.memory,
            "summary": self.summary(),
            "changed": self.changed(),
            "numerics": self.numerics(),
            "recommendations": self.recommended(),
            "units": self.units,
            "trials": self.trials,
            "ranks": None if self.ranks is None else {str(rank): rows for rank, rows in self.ranks.items()},
            "children": self.children or [],
            "cache": self.cache,
            "timeline": self.timeline,
            "shapes": self.shapes(),
        }

    def shapes(self):
        """What reached the training model, shape by shape (shape_buckets' figures), or None."""
        row = next((row for row in self.units if row["name"] == "shape_buckets"), None)
        return None if row is None else row.get("figures", {}).get("shapes")

    def changed(self) -> list:
        """What autogaudi changed in this run, unit by unit: the report's headline."""
        return [{"unit": row["name"], "what": what} for row in self.units for what in row.get("changes", ())]

    def numerics(self) -> list:
        """The units whose work in this run can have made its numbers differ from plain PyTorch's, and how."""
        return [
            {"unit": row["name"], "how": row["numerics"], "measured": row.get("numerics_measured")}
            for row in self.units
            if row.get("numerics")
        ]

    def recommended(self) -> list:
        """What autogaudi measured but leaves to the user, with what to try (``do``) and the share of
        a step it could save (``saves``: measured or estimated; None where unknown)."""
        return [{"unit": row["name"], **advice} for row in self.units for advice in row.get("recommendations", ())]

    def summary(self) -> dict:
        """The short report's facts: the run, each change with its measured effect, the trials not
        kept, those the run ended in, and the most useful next steps."""
        ms_per_step = round(1000 / self.steps["steps_per_s"], 3) if self.steps.get("steps_per_s") else None
        effects = {record["candidate"]: record for record in self.trials if "check" not in record}
        figures = {row["name"]: row.get("figures") or {} for row in self.units}
        steps = self.steps.get("steps", 0)
        seconds = round(sum(self.timeline["step_s"]) * self.timeline["every"], 3) if self.timeline else None
        changed = [
            {
                **change,
                "effect": effect(effects.get(change["unit"]), steps)
                or effect_of_part(figures.get(change["unit"], {}).get("update_ms"), ms_per_step, steps)
                or effect_of_batches(figures.get(change["unit"], {}), ms_per_step, steps),
            }
            for change in self.changed()
        ]
        return {
            "steps": steps,
            "seconds": seconds,
            "ms_per_step": ms_per_step,
            "whole_run": whole_run(
                changed,
                self.trials,
                self.units,
                seconds,
                (self.memory or {}).get("measuring_s", 0.0),
                start_up_s=(self.timeline or {}).get("start_up_s", 0.0),
                exit_s=(self.timeline or {}).get("exit_s", 0.0),
                per_call_s=(self.timeline or {}).get("per_call_s", 0.0),
            ),
            "changed": changed,
            "tried": [
                {
                    "unit": record["candidate"],
                    "speedup": record["speedup"],
                    "spread": spread(record),
                    "cost_s": trial_cost_s(record),
                }
                for record in effects.values()
                if record["decision"] in ("rejected", "stopped")
            ],
            "unfinished": [row["name"] for row in self.units if row.get("reason_code") == "trial_running"],
            "forced_off": self.forced_off(),
            "next": sorted(self.recommended(), key=lambda advice: -(advice.get("saves") or 0))[:NEXT_STEPS],
        }

    def forced_off(self) -> list:
        """Units the user forced (``--force``) that changed nothing in the end, and why: one that
        switched itself off (dynamic shapes), or did not apply here."""
        forced = (self.options or {}).get("force") or ()
        return [
            {"unit": row["name"], "reason_code": row.get("reason_code"), "reason": row.get("reason", "")}
            for row in self.units
            if row["name"] in forced and not row.get("changes")
        ]

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, default=str)

    def format(self, verbose=None) -> str:
        """The short report (what changed, its effect, what to try next); ``verbose`` (default: the
        ``verbose`` option) adds every unit's row, the trials, the advice in full and the cache."""
        if self.backend is None:
            return f"autogaudi {__version__}: enabled, waiting for torch to be imported\n"
        if verbose is None:
            verbose = bool((self.options or {}).get("verbose"))
        lines = self._short_lines()
        if verbose:
            lines.extend(self._table_lines())
        else:
            lines.append("  more     --verbose: every unit's row and reason; --report run.html: the step-time chart")
        # Last: what the next run does differently because of how this one ended (out of memory).
        lines += block(
            "next run",
            [
                f"{row['name']}: {row['figures']['next_run']['what']}"
                for row in self.units
                if row.get("figures", {}).get("next_run")
            ],
        )
        return "\n".join(lines) + "\n"

    __str__ = format

    def _short_lines(self) -> list:
        summary, backend = self.summary(), self.backend
        lines = where_lines(backend) + [
            f"autogaudi {__version__} report (torch {self.torch_version}{'' if self.active else ', disabled since'}) "
            f"on {backend['name']} ({backend['device']})",
            f"  run      {format_run(self.steps, summary)}",
        ]
        lines += block(
            "changed",
            [f"{change['unit']}: {change['what']}; {format_effect(change)}" for change in summary["changed"]],
        ) or ["  changed  nothing (--verbose says why for each unit)"]
        lines += block(
            "forced",
            [f"{row['unit']}: {row['reason'] or 'changed nothing'}" for row in summary["forced_off"]],
        )
        changed = {row["name"] for row in self.units if row.get("changes")}
        lines.append(f"  results  {format_results(self.numerics(), changed)}")
        if (self.memory or {}).get("matters"):
            lines.append(f"  memory   {format_memory(self.memory)}")
        from autogaudi.backends.hpu_signals import short_lines  # the backends load torch: only once a run reports

        lines += short_lines(backend)
        tried = [
            (
                f"{tried['unit']}: {format_speedup(tried['speedup'], tried['spread'])} in its trial, not kept"
                if tried["speedup"] is not None
                else f"{tried['unit']}: stopped in its warm-up, its one-off past the estimate's high end"
            )
            + f"; the trial cost {tried['cost_s']} s"
            for tried in summary["tried"]
        ]
        tried += [
            f"{name}: its trial was still running when the run ended; nothing kept" for name in summary["unfinished"]
        ]
        lines += block("tried", tried)
        coming = [format_next(advice, summary["ms_per_step"]) for advice in summary["next"]]
        lines += block("next", coming) or (
            [f"  next     nothing measured to try: {self._profile_reason()}"] if self._profile_reason() else []
        )
        if self.ranks is not None:
            lines.append(f"  ranks    {format_ranks(self.ranks)}")
        if self.children:
            lines.append(f"  children {format_children(self.children)}")
        return lines

    def _profile_reason(self) -> str:
        """What bounds the step, where the step profiler classified it."""
        row = next((row for row in self.units if row["name"] == PROFILER), None)
        bound = row["figures"].get("bound") if row is not None else None
        return f"the step is {bound}-bound (--verbose: by how much)" if bound else ""

    def _table_lines(self) -> list:
        backend = self.backend
        lines = [
            f"  backend  {backend['name']}: {backend['device']} ({backend['reason']})",
            f"  steps    {format_steps(self.steps)}",
        ]
        if self.memory:
            scalars = {k: v for k, v in self.memory.items() if not isinstance(v, dict)}
            lines.append("  memory   " + ", ".join(f"{k} {v}" for k, v in scalars.items()))
        width = max([len(row["name"]) for row in self.units] + [4])
        lines.append(f"  {'unit'.ljust(width)}  {'status':<11} reason")
        for row in self.units:
            detail = row["reason"]
            if row["figures"]:
                detail += (" | " if detail else "") + ", ".join(f"{k}={v}" for k, v in row["figures"].items())
            lines.append(f"  {row['name'].ljust(width)}  {row['status']:<11} {detail}")
            notes = [note for note in row["notes"] if note != row["reason"]]  # the reason line says it already
            lines.extend(f"  {''.ljust(width)}  {'':<11} note: {note}" for note in notes)
        for part in self.children or ():
            lines.append(f"  child    {format_child(part)}")
        for trial in self.trials:
            lines.append(f"  trial    {format_trial(trial)}")
        for row in self.recommended():
            lines.append(f"  advice   {row['unit']}: {row['what']}")
        if self.cache is not None:
            lines.append(f"  cache    {format_cache(self.cache)}")
            lines.extend(f"           note: {note}" for note in self.cache["notes"])
        return lines
