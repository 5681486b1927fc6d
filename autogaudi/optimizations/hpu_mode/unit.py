"""Lazy or eager on a Gaudi, measured and remembered, where asked for (``--trial hpu_mode``): where a
script runs in both, the next run tries the mode not yet measured (``PT_HPU_LAZY_MODE``, set before
the bridge loads), and later runs set the faster steady state, both figures in the report. Under the
defaults the release's default mode runs: the modes round differently, and a seeded script's numbers
would hang on the cache's state and on step times the machine's load moves.

Why: the bridge reads its mode once, when it loads; which mode is faster depends on the model, and
no documented rule says which. Measuring it costs one run in the slower mode, once per script.
How: the choice is :func:`autogaudi.entry.before_bridge.choose_hpu_mode`'s (mechanisms in :mod:`.modes`);
this unit reports it and, as the run ends, keeps its steady step time (steps after warm-up, between
step boundaries: :attr:`autogaudi.watch.steps.TrainingSteps.timed`) for this mode in autogaudi's cache.
"""

from __future__ import annotations

from autogaudi.core.candidate import untried_reason
from autogaudi.core.unit import ROUNDING, Unit, UnitSpec
from autogaudi.entry import before_bridge
from autogaudi.entry.main_script import script_path
from autogaudi.optimizations.hpu_mode import modes

_MEASURED = ("first_run", "trying_other", "remembered_faster")


class HpuMode(Unit):
    spec = UnitSpec(
        numerics=(ROUNDING,),  # lazy fuses a whole step into graphs, eager runs it op by op (by reading)
        exact_when="the release's default mode is kept",
        changed_figure=("mode_set", "{} run(s) with PT_HPU_LAZY_MODE set before the bridge loaded"),
        acts_on=("PT_HPU_LAZY_MODE, set before the bridge loads (taken back off at the run's end)",),
        reasons={
            "first_run": "{mode} mode, the release's default: its steady state is measured for this script; the next "
            "run tries the other mode",
            "trying_other": "{mode} mode, set to measure it: {other} mode was measured at {other_ms} ms/step",
            "remembered_faster": "{mode} mode, the faster measured for this script",
            "measured": "{mode} mode {ms} ms/step against {other} mode {other_ms} ms/step (steady state, steps after "
            "warm-up); later runs set {faster} mode",
            "not_measured": "{mode} mode: too few steps after warm-up to measure its steady state",
            "set_by_environment": "{mode} mode, set in the environment (PT_HPU_LAZY_MODE): not chosen",
            "script_tied": "{mode} mode only: the script uses HPU graphs (lazy only) or compiles itself (eager)",
            "bridge_loaded_first": "the bridge loaded before autogaudi could set PT_HPU_LAZY_MODE: run the script with "
            "python -m autogaudi or AUTOGAUDI=1, or call enable() before importing torch",
            "no_cache": "not chosen: no cache to remember the modes' step times in",
            "no_script": "not chosen: no script file to remember the modes' step times for",
            "other_device": "not chosen: not a Gaudi run",
            "error": "not chosen: {error}",
        },
    )

    def apply(self) -> None:
        decided = dict(before_bridge.LAST_MODE) or {"code": "no_script"}
        self._mode = "lazy" if self.run.backend.is_lazy else "eager"
        self.report.figures.update(mode=self._mode, mode_set=int(bool(decided.get("set"))))
        self._decided = decided
        if decided["code"] == "changes_numbers":  # the release's default mode, as plain runs it
            self.report.reason = untried_reason(self)
            return
        params = {"mode": self._mode, "error": decided.get("error")}
        record = decided.get("record") or {}
        other = "eager" if self._mode == "lazy" else "lazy"
        self.report.because(decided["code"], other=other, other_ms=record.get(other), **params)

    def run_ending(self, error) -> None:
        """Keep this mode's steady step time for the script, and report both figures."""
        cache, script, timed = self.run.cache, script_path(), self.run.steps.timed
        if self._decided["code"] not in _MEASURED or cache is None or script is None:
            return
        if timed is None:
            self.report.note("not_measured", mode=self._mode)
            return
        steps, seconds = timed
        record = modes.remember(cache, script, self._mode, 1000 * seconds / steps)
        self.report.figures.update({f"{mode}_ms_per_step": record[mode] for mode in modes.MODES if record[mode]})
        other = "eager" if self._mode == "lazy" else "lazy"
        if record[other]:
            faster, _code = modes.choose(record)
            self.report.note(
                "measured", mode=self._mode, ms=record[self._mode], other=other, other_ms=record[other], faster=faster
            )
