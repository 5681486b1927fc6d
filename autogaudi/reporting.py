"""What autogaudi did in this process: per unit applied (changed something), watching, not needed,
skipped or failed, why, and the figures.

At exit (rank 0 only) a short report goes to stderr: what changed and what it did to this run's
steps, and what to try next; ``--verbose`` adds every unit's row. The JSON (``--report PATH``) and
the page (``--report run.html``, :mod:`autogaudi.page`) carry all of it, so a person and a script
read the same facts.
"""

from __future__ import annotations

import json

from autogaudi._version import __version__

APPLIED, SKIPPED, FAILED = "applied", "skipped", "failed"
# What an applied (in force) unit reads as when it changed nothing: still measuring or deciding, or
# decided that nothing needs changing. "applied" is kept for units that changed something.
WATCHING, NOT_NEEDED = "watching", "not needed"
# The JSON report's layout: 2 since units that changed nothing read watching / not needed; 3 since
# recommendations are {what, do, saves} and the report carries a summary and a timeline.
SCHEMA = 3
NEXT_STEPS = 3  # the most useful recommendations the short report lists


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
        # A candidate on trial is on only in some steps: nothing is changed until it is kept.
        changes = unit.changes() if in_force and not unit.session.trials.trying(unit) else []
        status = self.status
        if in_force and not changes:
            status = WATCHING if unit.watching() else NOT_NEEDED
        return {
            "name": self.name,
            "summary": self.summary,
            "status": status,
            "changes": changes,
            "recommendations": [_advice(advice) for advice in unit.recommendations] if unit else [],
            "targets": list(unit.targets) + list(unit.acts_on) if unit else [],
            "reason": reason.text if reason is not None else "",
            "reason_code": reason.code if reason is not None else None,
            "reason_params": dict(reason.params) if reason is not None else {},
            "figures": dict(unit.figures) if unit else {},
            **_said("note", unit.notes if unit else []),
            # how what the unit did can have made the numbers differ from plain PyTorch's ([]: it cannot),
            # and by how much where the unit measured it (None: not measured; autogaudi.numerics.measured)
            **_numerics(unit if self.status != SKIPPED else None),
        }


def _numerics(unit) -> dict:
    how = list(unit.numerics_in_run()) if unit is not None else []
    return {"numerics": how, "numerics_measured": unit.figures.get("numerics_measured") if how else None}


def _where_lines(backend: dict) -> list:
    """The report's first line where the math did not run where the backend suggests: a CUDA script
    mapped onto hpu by Intel's GPU migration, or a model left on the host (autogaudi.placement)."""
    migration, placement = backend.get("migration"), backend.get("placement")
    lines = []
    if migration:
        count = migration.get("mapped_calls")
        mapped = f"{count} calls mapped" if count is not None else "calls mapped (not counted)"
        lines.append(
            f"autogaudi: the script asked for {migration['asked_for']}; it ran on {migration['ran_on']} through "
            f"{migration['through']}: {mapped}"
            + (f"; not mapped: {', '.join(migration['not_mapped'])}" if migration.get("not_mapped") else "")
        )
    if placement and not placement.get("on_device"):
        name = backend["name"]
        fix = "or let gpu_migration map the script's CUDA calls" if name == "hpu" else f"or move the model to {name}"
        lines.insert(
            0,
            f"autogaudi: the training ran on {placement['device']}, not on {name}: the {name} units stepped aside "
            f"(model_not_on_device); run with --device cpu, {fix}",
        )
    return lines


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
        self.children = children  # the parts child processes wrote (autogaudi.children), or None
        self.cache = cache  # the cache folder, what this run took from it and what it set, or None (--no-cache)
        self.timeline = timeline  # each step's seconds and the moments autogaudi acted (autogaudi.timeline)

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
        }

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
        return {
            "steps": self.steps.get("steps", 0),
            "seconds": round(sum(self.timeline["step_s"]) * self.timeline["every"], 3) if self.timeline else None,
            "ms_per_step": ms_per_step,
            "changed": [
                {
                    **change,
                    "effect": _effect(effects.get(change["unit"]), steps)
                    or _effect_of_part(figures.get(change["unit"], {}).get("update_ms"), ms_per_step, steps),
                }
                for change in self.changed()
            ],
            "tried": [
                {"unit": record["candidate"], "speedup": record["speedup"], "cost_s": _trial_cost_s(record)}
                for record in effects.values()
                if record["decision"] == "rejected"
            ],
            "unfinished": [row["name"] for row in self.units if row.get("reason_code") == "trial_running"],
            "next": sorted(self.recommended(), key=lambda advice: -(advice.get("saves") or 0))[:NEXT_STEPS],
        }

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
        lines += _block(
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
        lines = _where_lines(backend) + [
            f"autogaudi {__version__} report (torch {self.torch_version}{'' if self.active else ', disabled since'}) "
            f"on {backend['name']} ({backend['device']})",
            f"  run      {_format_run(self.steps, summary)}",
        ]
        lines += _block(
            "changed",
            [f"{change['unit']}: {change['what']}; {_format_effect(change)}" for change in summary["changed"]],
        ) or ["  changed  nothing (--verbose says why for each unit)"]
        differ = ", ".join(
            f"{row['unit']} ({', '.join(row['how'])}, {_format_size(row['measured'])})" for row in self.numerics()
        )
        lines.append(f"  results  {f'may differ from plain: {differ}' if differ else 'identical to plain'}")
        if (self.memory or {}).get("matters"):
            lines.append(f"  memory   {_format_memory(self.memory)}")
        from autogaudi.backends.hpu_signals import short_lines  # the backends load torch: only once a run reports

        lines += short_lines(backend)
        tried = [
            f"{tried['unit']}: {tried['speedup']}x in its trial, not kept; the trial cost {tried['cost_s']} s"
            for tried in summary["tried"]
        ]
        tried += [
            f"{name}: its trial was still running when the run ended; nothing kept" for name in summary["unfinished"]
        ]
        lines += _block("tried", tried)
        coming = [_format_next(advice, summary["ms_per_step"]) for advice in summary["next"]] + self._waiting_trials()
        lines += _block("next", coming) or (
            [f"  next     nothing measured to try: {self._profile_reason()}"] if self._profile_reason() else []
        )
        if self.ranks is not None:
            lines.append(f"  ranks    {_format_ranks(self.ranks)}")
        if self.children:
            lines.append(f"  children {_format_children(self.children)}")
        return lines

    def _waiting_trials(self) -> list:
        """Trials a unit holds back until the run has lasted long enough to pay for their one-off: what
        a longer run of the script would try."""
        return [
            f"{row['name']}: a trial waits for step {row['figures']['trial_waits_for_step']}, from where the run "
            "could pay for its one-off (--verbose: the estimate)"
            for row in self.units
            if row.get("reason_code") == "trial_waits" and "trial_waits_for_step" in row.get("figures", {})
        ]

    def _profile_reason(self) -> str:
        """What bounds the step, where the step profiler classified it."""
        row = next((row for row in self.units if row["name"] == "step_profiler"), None)
        bound = row["figures"].get("bound") if row is not None else None
        return f"the step is {bound}-bound (--verbose: by how much)" if bound else ""

    def _table_lines(self) -> list:
        backend = self.backend
        lines = [
            f"  backend  {backend['name']}: {backend['device']} ({backend['reason']})",
            f"  steps    {_format_steps(self.steps)}",
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
            lines.extend(f"  {''.ljust(width)}  {'':<11} note: {note}" for note in row["notes"])
        for part in self.children or ():
            lines.append(f"  child    {_format_child(part)}")
        for trial in self.trials:
            lines.append(f"  trial    {_format_trial(trial)}")
        for row in self.recommended():
            lines.append(f"  advice   {row['unit']}: {row['what']}")
        if self.cache is not None:
            lines.append(f"  cache    {_format_cache(self.cache)}")
            lines.extend(f"           note: {note}" for note in self.cache["notes"])
        return lines


def _block(label: str, items: list) -> list:
    """Lines under one label: the label on the first, the others indented under it."""
    return [f"  {label if index == 0 else '':<9}{item}" for index, item in enumerate(items)]


def _effect(record, steps: int):
    """What a kept trial's change did over the whole run: the step time before and with it, and
    the seconds it saved net of its one-off, from the trial's start to the run's end; None where
    the change was not timed against the step without it (on from the start, or remembered)."""
    if record is None or record["decision"] != "kept":
        return None
    without_steps = sum(count for arm, count in record.get("arms", ()) if arm == "without")
    steps_with = max(0, steps - record["started_at_step"] - without_steps)
    saved = (record["ms_per_step_without"] - record["ms_per_step_with"]) / 1000 * steps_with - record["one_off_s"]
    return {
        "ms_per_step_without": record["ms_per_step_without"],
        "ms_per_step_with": record["ms_per_step_with"],
        "speedup": record["speedup"],
        "one_off_s": record["one_off_s"],
        "steps_with": steps_with,
        "saved_s": round(saved, 3),
    }


def _trial_cost_s(record) -> float:
    """What a trial not kept cost the run: its one-off and its "with" steps beyond the step without."""
    with_steps = sum(count for arm, count in record.get("arms", ()) if arm == "with")
    extra = (record["ms_per_step_with"] - record["ms_per_step_without"]) / 1000 * with_steps
    return round(record["one_off_s"] + extra, 3)


def _effect_of_part(update_ms, ms_per_step, steps: int):
    """A change timed on its own part of the step (a fused optimizer's update against torch's
    unfused one, on the same steps): the step without it is the step with it plus the difference."""
    if not update_ms or not ms_per_step:
        return None
    difference = update_ms["unfused"] - update_ms["fused"]
    without = round(ms_per_step + difference, 3)
    return {
        "ms_per_step_without": without,
        "ms_per_step_with": ms_per_step,
        "speedup": round(without / ms_per_step, 3),
        "one_off_s": 0.0,
        "steps_with": steps,
        "saved_s": round(difference / 1000 * steps, 3),
        "timed": f"the update alone in {update_ms['steps']} steps: {update_ms['unfused']} -> {update_ms['fused']} ms",
    }


def _format_effect(change: dict) -> str:
    effect = change["effect"]
    if effect is None:
        return "not timed without it (in force from the start)"
    net = "saved" if effect["saved_s"] >= 0 else "lost"
    text = (
        f"{effect['ms_per_step_without']} -> {effect['ms_per_step_with']} ms/step ({effect['speedup']}x); this run: "
        f"{abs(effect['saved_s'])} s {net} over {effect['steps_with']} steps"
    )
    if "timed" in effect:
        return text + f" ({effect['timed']})"
    return text + f", one-off {effect['one_off_s']} s included"


def _format_memory(memory: dict) -> str:
    """A step's peak against the budget, and what it is made of, largest part first."""
    peak = memory["peak_bytes"] or memory["predicted_peak_bytes"]
    how = "measured" if memory["peak_bytes"] else "forecast"
    text = f"a step's peak {_mb(peak)} ({how}) of a {_mb(memory['budget_bytes'])} budget"
    if memory["peak_bytes"] and memory["predicted_peak_bytes"]:
        text += f", forecast {_mb(memory['predicted_peak_bytes'])}"
    parts = sorted((memory.get("parts") or {}).items(), key=lambda part: -part[1])
    shares = [f"{name.replace('_', ' ')} {size / peak:.0%}" for name, size in parts if size and peak]
    return text + (f": {', '.join(shares)}" if shares else "")


def _mb(size) -> str:
    return f"{size / 1e6:.1f} MB"


def _format_size(measured) -> str:
    """How much a unit's numbers moved, as measured (``numerics_measured``), or that it was not."""
    if not measured:
        return "not measured"
    if measured["max_rel_diff"] == 0:
        return f"{measured['of']} identical in the {measured['steps']} steps measured"
    return f"{measured['of']} ≤{measured['max_rel_diff']:.2g} relative per step, measured"


def _format_next(advice: dict, ms_per_step) -> str:
    text = advice.get("do") or advice["what"]
    saves = advice.get("saves")
    if saves:
        figure = f"up to {saves:.0%} of a step"
        if ms_per_step:
            figure += f", {round(saves * ms_per_step, 1)} ms"
        text += f" ({figure}, {advice.get('saves_basis', 'estimated')})"
    return text


def _format_run(steps: dict, summary: dict) -> str:
    count = steps.get("steps", 0)
    text = f"{count} training step{'' if count == 1 else 's'}"
    if steps.get("steps_counted_by") == "backward passes":
        per_step = steps.get("backward_passes_per_step") or 1
        text += f" (no optimizer: {per_step} backward pass{'' if per_step == 1 else 'es'} each)"
    if count and summary["seconds"] is not None:
        text += f" in {_seconds(summary['seconds'])} s"
    if summary["ms_per_step"] is not None:
        text += f", {summary['ms_per_step']:.4g} ms/step after {steps.get('warmup_steps', 0)} warm-up"
    if steps.get("decisions_settled_at_step") is not None:
        text += f"; every decision made by step {steps['decisions_settled_at_step']}"
    not_steps = _not_steps(steps)
    if not_steps:
        text += f"; not steps: {not_steps}"
    return text


def _seconds(seconds: float) -> str:
    return f"{seconds:.1f}" if seconds >= 10 else f"{seconds:.3g}"


def _not_steps(steps: dict) -> str:
    """The passes that are no training step of their own, named."""
    kinds = (
        ("backward_passes_in_optimizer_steps", "backward passes inside optimizer steps (closures)"),
        ("own_backward_passes", "backward passes autogaudi's own or inside another pass"),
        ("evaluation_forward_passes", "evaluation forward passes (no gradients)"),
    )
    named = [f"{steps[key]} {words}" for key, words in kinds if steps.get(key)]
    if steps.get("evaluation_counted_until_step") is not None:
        named.append(
            f"forward passes without gradients counted until step {steps['evaluation_counted_until_step']} "
            "(the loop makes them every step)"
        )
    return ", ".join(named)


def _format_cache(cache: dict) -> str:
    if cache["dir"] is None:
        return f"not used: decisions {cache['decisions']}"
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


def _format_children(parts: list) -> str:
    """The child processes that trained, in one line: their steps, and each unit that changed
    something in them, in how many."""
    count = len(parts)
    started_by = ", ".join(sorted({part["started_by"] for part in parts}))
    text = f"{count} child process{'' if count == 1 else 'es'} ({started_by}): "
    text += f"{sum(part['steps']['steps'] for part in parts)} training steps in all"
    evaluations = sum(part["steps"].get("evaluation_forward_passes", 0) for part in parts)
    if evaluations:
        text += f", {evaluations} evaluation forward passes"
    changed = {}
    for part in parts:
        for unit in dict.fromkeys(change["unit"] for change in part["changed"]):
            changed[unit] = changed.get(unit, 0) + 1
    text += "; " + (
        ", ".join(f"{unit} applied in {'each' if n == count else f'{n} of {count}'}" for unit, n in changed.items())
        or "nothing changed in them"
    )
    differ = sorted({row["unit"] for part in parts for row in part["numerics"]})
    if differ:
        text += f"; results may differ from plain there: {', '.join(differ)}"
    return text


def _format_child(part: dict) -> str:
    changed = "; ".join(f"{change['unit']}: {change['what']}" for change in part["changed"]) or "nothing changed"
    return f"pid {part['pid']} ({part['started_by']}): {_format_steps(part['steps'])}; {changed}"


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
    not_steps = _not_steps(steps)
    if not_steps:
        text += f"; not steps: {not_steps}"
    return text
