"""The report's lines: each figure as the short report and ``--verbose`` state it."""

from __future__ import annotations

from autogaudi.reporting.effects import spread


def where_lines(backend: dict) -> list:
    """The report's first line where the math did not run where the backend suggests: a CUDA script
    mapped onto hpu by Intel's GPU migration, or a model left on the host (autogaudi.watch.placement)."""
    migration, placement = backend.get("migration"), backend.get("placement")
    lines = []
    if migration:
        count = migration.get("mapped_calls")
        mapped = f"{count} calls mapped" if count is not None else "calls mapped (not counted)"
        where = (
            f"it ran on {migration['ran_on']} through {migration['through']}"
            if migration["ran_on"] == backend["name"]
            else f"{migration['through']} was on, but the script put its model on {migration['ran_on']} itself"
        )
        lines.append(
            f"autogaudi: the script asked for {migration['asked_for']}; {where}: {mapped}"
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


def block(label: str, items: list) -> list:
    """Lines under one label: the label on the first, the others indented under it."""
    return [f"  {label if index == 0 else '':<9}{item}" for index, item in enumerate(items)]


def format_speedup(speedup, spread) -> str:
    """A speed-up with its spread where the measurement has one: "1.09x ±4%"."""
    return f"{speedup}x ±{spread:.0%}" if spread is not None else f"{speedup}x"


def format_effect(change: dict) -> str:
    effect = change["effect"]
    if effect is None:
        return "not timed without it (in force from the start)"
    text = (
        f"{effect['ms_per_step_without']} -> {effect['ms_per_step_with']} ms/step "
        f"({format_speedup(effect['speedup'], effect.get('spread'))}); this run: "
    )
    if not effect.get("claimed", True):
        text += f"within noise over {effect['steps_with']} steps (±{effect['noise_s']} s): no saving claimed"
        return text + (f", one-off {effect['one_off_s']} s paid" if effect["one_off_s"] else "")
    net = "saved" if effect["saved_s"] >= 0 else "lost"
    noise = f" ±{effect['noise_s']}" if effect.get("noise_s") is not None else ""
    text += f"{abs(effect['saved_s'])}{noise} s {net} over {effect['steps_with']} steps"
    if "timed" in effect:
        return text + f" ({effect['timed']})"
    return text + f", one-off {effect['one_off_s']} s included"


def format_whole_run(whole: dict, changed: list) -> str:
    """The run against plain PyTorch, autogaudi's own cost included; "" where autogaudi neither
    changed nor paid anything."""
    if not changed and not whole["cost_s"]:
        return ""
    text = ""
    if whole["cost_s"]:
        parts = (
            ("start", "start_up_s"),
            ("exit", "exit_s"),
            ("per-call work", "per_call_s"),
            ("one-offs", "one_offs_s"),
            ("trials' arms", "trial_arms_s"),
            ("measuring", "measuring_s"),
        )
        detail = ", ".join(f"{words} {whole[key]} s" for words, key in parts if whole.get(key))
        text = f"autogaudi's own cost {whole['cost_s']} s ({detail}); "
    if whole["net_s"] is None:
        untimed = ", ".join(change["unit"] for change in changed if change["effect"] is None)
        return text + f"against plain: not known ({untimed} not timed without it)"
    if not whole["claimed"]:
        return text + f"against plain: within noise ({whole['net_s']:+} s ±{whole['noise_s']} s)"
    how = "faster" if whole["net_s"] > 0 else "slower"
    noise = f" ±{whole['noise_s']}" if whole["noise_s"] is not None else ""
    text += f"against plain: {abs(whole['net_s'])}{noise} s {how} in all"
    if whole["plain_s"] and whole["plain_s"] > 0:
        text += f" (plain about {_seconds(whole['plain_s'])} s)"
    return text


def format_memory(memory: dict) -> str:
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


def format_size(measured) -> str:
    """How much a unit's numbers moved, as measured (``numerics_measured``), or that it was not."""
    if not measured:
        return "not measured"
    if measured["max_rel_diff"] == 0:
        return f"{measured['of']} identical in the {measured['steps']} steps measured"
    return f"{measured['of']} ≤{measured['max_rel_diff']:.2g} relative per step, measured"


def format_next(advice: dict, ms_per_step) -> str:
    text = advice.get("do") or advice["what"]
    saves = advice.get("saves")
    if saves:
        figure = f"up to {saves:.0%} of a step"
        if ms_per_step:
            figure += f", {round(saves * ms_per_step, 1)} ms"
        text += f" ({figure}, {advice.get('saves_basis', 'estimated')})"
    return text


def format_run(steps: dict, summary: dict) -> str:
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
    whole = format_whole_run(summary["whole_run"], summary["changed"])
    if whole:
        text += f"; {whole}"
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
    until = steps.get("evaluation_counted_until_step")
    named = [f"{steps[key]} {words}" for key, words in kinds[: 2 if until is not None else 3] if steps.get(key)]
    if until is not None:  # a rollout-like loop: its count stopped there (autogaudi.watch.evaluation)
        named.append(
            f"{steps.get('evaluation_forward_passes', 0)} evaluation forward passes counted in the first {until} "
            "steps, none after: the loop makes them more often than it steps, and counting each would slow it"
        )
    return ", ".join(named)


def format_cache(cache: dict) -> str:
    if cache["dir"] is None:
        return f"not used: decisions {cache['decisions']}"
    text = f"{cache['dir']}: decisions {cache['decisions']}"
    set_here = [name for name, setting in cache["compile"].items() if setting["set_by"] == "autogaudi"]
    if set_here:
        text += f"; compile caches kept there ({', '.join(set_here)})"
    return text


def format_trial(trial: dict) -> str:
    if "check" in trial:
        return (
            f"{trial['candidate']}: {trial['ms_per_step']} ms/step {trial['arm']} it, against "
            f"{trial['ms_per_step_remembered']} remembered ({trial['ratio']}x) over {trial['steps']} steps "
            f"-> {trial['decision']}"
        )
    text = (
        f"{trial['candidate']}: {trial['ms_per_step_with']} ms/step with, {trial['ms_per_step_without']} without "
        f"({format_speedup(trial['speedup'], spread(trial))}) over {trial['steps']} steps, one-off "
        f"{trial['one_off_s']} s -> {trial['decision']}"
    )
    if "pays_back_after_steps" in trial:
        text += f", pays back after {trial['pays_back_after_steps']} steps"
    return text


def format_ranks(ranks: dict) -> str:
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


def format_children(parts: list) -> str:
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


def format_child(part: dict) -> str:
    changed = "; ".join(f"{change['unit']}: {change['what']}" for change in part["changed"]) or "nothing changed"
    return f"pid {part['pid']} ({part['started_by']}): {format_steps(part['steps'])}; {changed}"


def format_steps(steps: dict) -> str:
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


def format_results(numerics: list, changed: set) -> str:
    """Whether the run's numbers can differ from plain PyTorch's, and through which unit; a unit
    whose change was not kept (not in ``changed``: put back, its trial rejected) is named for the
    steps it was on in, not as having changed the run."""
    kept = [row for row in numerics if row["unit"] in changed]
    tried = [row for row in numerics if row["unit"] not in changed]
    parts = [f"{row['unit']} ({', '.join(row['how'])}, {format_size(row['measured'])})" for row in kept]
    parts += [
        f"{row['unit']}'s timed steps only ({', '.join(row['how'])}; not kept, the rest ran as plain)" for row in tried
    ]
    return f"may differ from plain: {', '.join(parts)}" if parts else "identical to plain"
