"""What a unit's change did to this run, and what autogaudi itself cost it, from the trials' records
and the units' figures: the figures the report states as gains, each with its noise.

Why the noise: a trial's arms are medians of a few steps on a machine that may be busy; two
identical runs read 1.09x and 1.19x. Where a record carries each arm's spread (``spread_with``,
``spread_without``: fractions of the arm's median) a speed-up is stated with it, and a saving is
claimed only where it is larger than the noise over the same steps; else the report says "within
noise" and claims nothing. Where a record has no spread the figure stands as measured, with no ±.

Why the whole run: a change kept for its steady-state speed-up can still leave the run slower than
plain PyTorch, once its one-off, the slower arms of trials not kept and later compiles are paid.
:func:`whole_run` sets those against what the kept changes saved.
"""

from __future__ import annotations

import math

# One-offs a unit pays after its trial (new input shapes compiled, compile workers stopped at exit):
# on top of the trial's record.
LATER_ONE_OFFS = ("later_compiles_s", "compile_workers_at_exit_s")
# Units' figures for steps they measured in, beyond those steps' own time: autogaudi's cost.
MEASURING_STEPS = ("census_extra_s",)


def spread(record) -> float | None:
    """The spread of a trial's speed-up (a fraction), from its arms' spreads; None where the record
    has none."""
    with_, without = record.get("spread_with"), record.get("spread_without")
    if with_ is None or without is None:
        return None
    return math.hypot(with_, without)


def _noise_ms(record) -> float | None:
    """The noise of a trial's per-step difference (ms), from its arms' spreads; None where unknown."""
    with_, without = record.get("spread_with"), record.get("spread_without")
    if with_ is None or without is None:
        return None
    return math.hypot(record["ms_per_step_with"] * with_, record["ms_per_step_without"] * without)


def effect(record, steps: int):
    """What a kept trial's change did over the whole run: the step time before and with it, and
    the seconds it saved net of its one-off, from the trial's start to the run's end; None where
    the change was not timed against the step without it (on from the start, or remembered).
    ``noise_s``: the saving's noise over the same steps (None where unknown); ``claimed``: whether
    the saving is beyond it (always where the noise is unknown)."""
    if record is None or record["decision"] != "kept":
        return None
    without_steps = sum(count for arm, count in record.get("arms", ()) if arm == "without")
    steps_with = max(0, steps - record["started_at_step"] - without_steps)
    saved = (record["ms_per_step_without"] - record["ms_per_step_with"]) / 1000 * steps_with - record["one_off_s"]
    return {
        "ms_per_step_without": record["ms_per_step_without"],
        "ms_per_step_with": record["ms_per_step_with"],
        "speedup": record["speedup"],
        "spread": _rounded(spread(record)),
        "one_off_s": record["one_off_s"],
        "steps_with": steps_with,
        **_saving(saved, _noise_ms(record), steps_with),
    }


def _saving(saved_s: float, noise_ms, steps: int) -> dict:
    """A saving over ``steps`` with its noise over the same steps (``noise_ms`` a step's, None where
    unknown): claimed only where it is beyond the noise, always where the noise is unknown."""
    noise_s = round(noise_ms / 1000 * steps, 3) if noise_ms is not None else None
    return {"saved_s": round(saved_s, 3), "noise_s": noise_s, "claimed": noise_s is None or abs(saved_s) > noise_s}


def trial_cost_s(record) -> float:
    """What a trial not kept cost the run: its one-off and its "with" steps beyond the step without."""
    with_steps = sum(count for arm, count in record.get("arms", ()) if arm == "with")
    if not with_steps:  # stopped in its warm-up: the one-off is all it cost
        return round(record["one_off_s"], 3)
    extra = (record["ms_per_step_with"] - record["ms_per_step_without"]) / 1000 * with_steps
    return round(record["one_off_s"] + extra, 3)


def part_measuring_s(update_ms) -> float:
    """A part timed on its own (a fused optimizer's update) ran the fused update beside the run's own
    in its timed steps, on copies: autogaudi's cost, whether the change was kept or not."""
    return round(update_ms["fused"] / 1000 * update_ms["steps"], 3)


def effect_of_part(update_ms, ms_per_step, steps: int):
    """A change timed on its own part of the step (a fused optimizer's update against torch's
    unfused one, on the same steps): the step without it is the step with it plus the difference."""
    if not update_ms or not ms_per_step:
        return None
    steps = max(0, steps - update_ms["steps"] - 1)  # in its first step and its timed ones, the run's was unfused
    timed = f"the update alone in {update_ms['steps']} steps: {update_ms['unfused']} -> {update_ms['fused']} ms"
    difference = update_ms["unfused"] - update_ms["fused"]
    return _part_effect(difference, ms_per_step, steps, part_measuring_s(update_ms), timed)


def effect_of_batches(figures: dict, ms_per_step, steps: int):
    """A loader given workers: its batch in-process (waiting and computing: the plain run's step),
    timed before tuning, against the run's own steps. Not against the window timed with workers: a
    run's steps also pay for each epoch's workers starting and stopping, which that window leaves out."""
    before, after = figures.get("ms_per_batch_before"), figures.get("ms_per_batch_after")
    if before is None or after is None or not ms_per_step or not figures.get("loaders_tuned"):
        return None
    steps = max(0, steps - (figures.get("workers_from_batch") or 0))
    timed = f"a batch in-process and with workers: {before:.1f} -> {after:.1f} ms"
    return _part_effect(before - ms_per_step, ms_per_step, steps, 0.0, timed, figures.get("ms_per_batch_noise"))


def _part_effect(
    difference: float, ms_per_step: float, steps: int, measuring_s: float, timed: str, noise_ms=None
) -> dict:
    """``noise_ms``: the per-step difference's noise where its windows have one (a saving within it
    is not claimed, as a trial's)."""
    without = round(ms_per_step + difference, 3)
    return {
        "ms_per_step_without": without,
        "ms_per_step_with": ms_per_step,
        "speedup": round(without / ms_per_step, 3),
        "spread": None,
        "one_off_s": 0.0,
        "steps_with": steps,
        **_saving(difference / 1000 * steps, noise_ms, steps),
        "measuring_s": measuring_s,  # autogaudi's cost, not the change's
        "timed": timed,
    }


def figures_sum(units: list, names: tuple) -> float:
    """The units' figures of these names added up (a figure absent or None counts 0)."""
    return sum((row.get("figures") or {}).get(name) or 0.0 for row in units for name in names)


def whole_run(
    changed: list,
    trials: list,
    units: list,
    seconds,
    memory_s: float = 0.0,
    start_up_s: float = 0.0,
    per_call_s: float = 0.0,
    exit_s: float = 0.0,
) -> dict:
    """The run against plain PyTorch, autogaudi's own cost included: ``cost_s`` what autogaudi paid
    that plain would not (the trials' one-offs, the "with" arms of trials not kept beyond their
    "without", later one-offs, a change's measuring steps whether kept or put back, the step
    profile's census steps, ``memory_s``: the step's memory forecast and tracked step, ``start_up_s``:
    its imports and start, ``per_call_s``: its wrappers' and hooks' time in the user's calls, ``exit_s``:
    its work at exit up to the report), ``saved_s``
    what the kept changes saved net of their one-offs, ``net_s`` the two together (None where a
    change was not timed against the step without it: plain's time is not known then), ``noise_s``
    its noise (None where unknown), and ``plain_s``, the steps' time plain would have taken (the
    start and exit are outside the steps), where ``net_s`` is known."""
    decided = [record for record in trials if "check" not in record]
    one_offs = sum(record["one_off_s"] for record in decided)
    arms = sum(trial_cost_s(record) - record["one_off_s"] for record in decided if record["decision"] != "kept")
    later = figures_sum(units, LATER_ONE_OFFS)
    effects = [change["effect"] for change in changed]
    kept = {change["unit"] for change in changed}
    put_back = sum(
        part_measuring_s(row["figures"]["update_ms"])
        for row in units
        if row["name"] not in kept and (row.get("figures") or {}).get("update_ms")
    )
    measuring = (
        memory_s
        + put_back
        + figures_sum(units, MEASURING_STEPS)
        + sum(effect.get("measuring_s", 0.0) for effect in effects if effect is not None)
    )
    outside_steps = start_up_s + exit_s
    cost = one_offs + arms + later + measuring + outside_steps + per_call_s
    timed = all(effect is not None for effect in effects)
    # the kept changes' savings before their one-offs, which cost_s holds
    gross = sum(effect["saved_s"] + effect["one_off_s"] for effect in effects if effect is not None)
    net = gross - cost if timed else None
    noises = [effect["noise_s"] for effect in effects if effect is not None]
    noise = round(sum(noises), 3) if timed and all(n is not None for n in noises) and noises else None
    return {
        "cost_s": round(cost, 3),
        "one_offs_s": round(one_offs + later, 3),
        "trial_arms_s": round(arms, 3),
        "measuring_s": round(measuring, 3),
        "start_up_s": round(start_up_s, 3),
        "exit_s": round(exit_s, 3),
        "per_call_s": round(per_call_s, 3),
        "saved_s": round(gross, 3),
        "net_s": round(net, 3) if net is not None else None,
        "noise_s": noise,
        "claimed": net is not None and (noise is None or abs(net) > noise),
        # the steps' time plain would have taken: autogaudi's start and exit are no part of the steps' seconds
        "plain_s": round(seconds + net + outside_steps, 3) if net is not None and seconds is not None else None,
    }


def _rounded(fraction):
    return round(fraction, 3) if fraction is not None else None
