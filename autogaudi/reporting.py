"""What autogaudi did in this process: per unit applied (changed something), watching, not needed,
skipped or failed, why, and the figures.

The same content is printed as a table on stderr at exit (rank 0 only) and written as JSON when the
``report`` option names a path, so a person and a script read the same facts.
"""

from __future__ import annotations

import json

from autogaudi._version import __version__

APPLIED, SKIPPED, FAILED = "applied", "skipped", "failed"
# What an applied (in force) unit reads as when it changed nothing: still measuring or deciding, or
# decided that nothing needs changing. "applied" is kept for units that changed something.
WATCHING, NOT_NEEDED = "watching", "not needed"
# The JSON report's layout: 2 since units that changed nothing read watching / not needed.
SCHEMA = 2


def _said(kind: str, reasons: list) -> dict:
    """A unit's notes or recommendations (``kind``: "note", "recommendation") as the report carries
    them: the texts, and beside them the same as data, as a unit's reason is (codes and values)."""
    return {
        f"{kind}s": [reason.text for reason in reasons],
        f"{kind}_codes": [reason.code for reason in reasons],
        f"{kind}_params": [dict(reason.params) for reason in reasons],
    }


class UnitRow:
    """One unit's line in the report."""

    def __init__(self, name: str, summary: str):
        self.name = name
        self.summary = summary
        self.status = SKIPPED
        self.reason = None  # a Reason, or None while the unit is in force (its own reason is read live)
        self.unit = None  # the unit object once loaded: its targets, figures and notes are live

    def set(self, status: str, reason=None) -> None:
        self.status = status
        self.reason = reason

    def as_dict(self) -> dict:
        unit = self.unit
        in_force = unit is not None and self.status == APPLIED
        reason = unit.reason if in_force else self.reason
        changes = unit.changes() if in_force else []
        status = self.status
        if in_force and not changes:
            status = WATCHING if unit.watching() else NOT_NEEDED
        return {
            "name": self.name,
            "summary": self.summary,
            "status": status,
            "changes": changes,
            **_said("recommendation", unit.recommendations if unit else []),
            "targets": list(unit.targets) + list(unit.acts_on) if unit else [],
            "reason": reason.text if reason is not None else "",
            "reason_code": reason.code if reason is not None else None,
            "reason_params": dict(reason.params) if reason is not None else {},
            "figures": dict(unit.figures) if unit else {},
            **_said("note", unit.notes if unit else []),
        }


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
        cache=None,
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
        self.cache = cache  # the cache folder, what this run took from it and what it set, or None (--no-cache)

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
            "changed": self.changed(),
            "recommendations": self.recommended(),
            "units": self.units,
            "trials": self.trials,
            "ranks": None if self.ranks is None else {str(rank): rows for rank, rows in self.ranks.items()},
            "cache": self.cache,
        }

    def changed(self) -> list:
        """What autogaudi changed in this run, unit by unit: the report's headline."""
        return [{"unit": row["name"], "what": what} for row in self.units for what in row.get("changes", ())]

    def recommended(self) -> list:
        """What autogaudi measured but leaves to the user, with what to try."""
        return [
            {"unit": row["name"], "what": what, "code": code, "params": params}
            for row in self.units
            for what, code, params in zip(
                row.get("recommendations", ()),
                row.get("recommendation_codes", ()),
                row.get("recommendation_params", ()),
            )
        ]

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, default=str)

    def format(self) -> str:
        if self.backend is None:
            return f"autogaudi {__version__}: enabled, waiting for torch to be imported\n"
        backend = self.backend
        lines = [
            f"autogaudi {__version__} report (torch {self.torch_version}{'' if self.active else ', disabled since'})",
            f"  backend  {backend['name']}: {backend['device']} ({backend['reason']})",
            f"  steps    {_format_steps(self.steps)}",
        ]
        if self.memory:
            lines.append("  memory   " + ", ".join(f"{k} {v}" for k, v in self.memory.items()))
        changed = self.changed()
        lines.append(
            f"  changed  {len(changed)} thing{'' if len(changed) == 1 else 's'}"
            + (":" if changed else " (each unit's reason below says why)")
        )
        lines.extend(f"           {row['unit']}: {row['what']}" for row in changed)
        width = max([len(row["name"]) for row in self.units] + [4])
        lines.append(f"  {'unit'.ljust(width)}  {'status':<11} reason")
        for row in self.units:
            detail = row["reason"]
            if row["figures"]:
                detail += (" | " if detail else "") + ", ".join(f"{k}={v}" for k, v in row["figures"].items())
            lines.append(f"  {row['name'].ljust(width)}  {row['status']:<11} {detail}")
            lines.extend(f"  {''.ljust(width)}  {'':<11} note: {note}" for note in row["notes"])
        for trial in self.trials:
            lines.append(f"  trial    {_format_trial(trial)}")
        for row in self.recommended():
            lines.append(f"  advice   {row['unit']}: {row['what']}")
        if self.ranks is not None:
            lines.append(f"  ranks    {_format_ranks(self.ranks)}")
        if self.cache is not None:
            lines.append(f"  cache    {_format_cache(self.cache)}")
            lines.extend(f"           note: {note}" for note in self.cache["notes"])
        return "\n".join(lines) + "\n"

    __str__ = format


def _format_cache(cache: dict) -> str:
    text = f"{cache['dir']}: decisions {cache['decisions']}"
    set_here = [name for name, setting in cache["compile"].items() if setting["set_by"] == "autogaudi"]
    if set_here:
        text += f"; compile caches kept there ({', '.join(set_here)})"
    return text


def _format_trial(trial: dict) -> str:
    if "check" in trial:
        return (
            f"{trial['candidate']}: {trial['ms_per_step']} ms/step {trial['arm']} it, against "
            f"{trial['ms_per_step_remembered']} remembered ({trial['ratio']}x) over {trial['steps']} steps "
            f"-> {trial['decision']}"
        )
    text = (
        f"{trial['candidate']}: {trial['ms_per_step_with']} ms/step with, {trial['ms_per_step_without']} without "
        f"({trial['speedup']}x) over {trial['steps']} steps, one-off {trial['one_off_s']} s -> {trial['decision']}"
    )
    if "pays_back_after_steps" in trial:
        text += f", pays back after {trial['pays_back_after_steps']} steps"
    return text


def _format_ranks(ranks: dict) -> str:
    """Whether every rank made the same decision (status) for every unit; the differences if not."""
    answered = {rank: {row["name"]: row["status"] for row in rows} for rank, rows in ranks.items() if rows is not None}
    text = f"{len(answered)} of {len(ranks)} reported their unit decisions"
    silent = [str(rank) for rank, rows in ranks.items() if rows is None]
    if silent:
        text += f" (no answer from rank {', '.join(silent)})"
    names = {name for statuses in answered.values() for name in statuses}
    differing = sorted(name for name in names if len({other.get(name) for other in answered.values()}) > 1)
    if not differing:
        return text + "; all the same"
    return (
        text
        + "; they differ: "
        + "; ".join(
            f"{name}: " + ", ".join(f"rank {rank} {statuses.get(name)}" for rank, statuses in answered.items())
            for name in differing
        )
    )


def _format_steps(steps: dict) -> str:
    text = f"{steps.get('optimizer_steps', 0)} optimizer steps, {steps.get('backward_passes', 0)} backward passes"
    if steps.get("steps_counted_by"):
        text = f"{steps['steps']} training steps (counted by {steps['steps_counted_by']}): " + text
    if "steps_per_s" in steps:
        text += (
            f"; {steps['steps_per_s']} steps/s over {steps['timed_steps']} steps after {steps['warmup_steps']} warm-up"
        )
    if steps.get("decisions_settled_at_step") is not None:
        text += f"; every decision made by step {steps['decisions_settled_at_step']}"
    return text
