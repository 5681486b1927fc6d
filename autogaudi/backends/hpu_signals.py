"""Gaudi's run-time signals in the report: ops the bridge ran on the CPU, and graphs it compiled
after warm-up, with what the Gaudi guides do about each.

Why: both cost every step they happen in and neither shows in a plain run's output (the bridge logs
fallbacks only under ``PT_HPU_LOG_MOD_MASK=0x80 PT_HPU_LOG_TYPE_MASK=0x8``). The bridge counts them itself
(``habana_frameworks.torch.hpu.metrics.metric_global``: ``cpu_fallback`` with ``TotalNumber`` and
``FallbackOps`` {op: count}, ``graph_compilation`` with ``TotalNumber`` and ``TotalTime`` in µs);
this module reads those counts at each training step's end and keeps what changed in that step. The
input shapes are the DataLoader batch the step trained on (what the model call was given): a graph
compiled after warm-up on a batch shaped unlike the warm-up's names its cause. Compilations in a step
where one of autogaudi's trials ran (a graph capture on trial compiles its graphs) are counted apart:
they are autogaudi's, not the script's.
"""

from __future__ import annotations

import os
import re

import torch

from autogaudi.core.events import Event
from autogaudi.core.reasons import Reason
from autogaudi.entry.main_script import script_path

# code -> text: what the report says of each signal (the JSON carries code and params, as a unit's).
REASONS = {
    "cpu_fallback": "{op} ran on the CPU {count}x in {steps} step(s) after warm-up (script line: {line}): "
    "each run is a round trip to the host; use a dtype the device supports (float32 or bfloat16, not float64) or an op "
    "it has (the bridge logs each fallback with PT_HPU_LOG_MOD_MASK=0x80 PT_HPU_LOG_TYPE_MASK=0x8)",
    "recompiled_short_batch": "{count} graph compilation(s) after warm-up on a shorter batch {shapes} (warm-up: "
    "{warmup_shapes}): keep the last batch whole (DataLoader drop_last=True, or autogaudi's static_last_batch)",
    "recompiled_new_shapes": "{count} graph compilation(s) after warm-up on new input shapes {shapes} (warm-up: "
    "{warmup_shapes}): keep shapes static (pad to a few fixed sizes, bucket sequence lengths)",
    "recompiled_same_shapes": "{count} graph compilation(s) after warm-up with the warm-up's input shapes: a "
    "Python number passed to the model that changes (pass a device tensor), or a mark_step that cuts "
    "the step differently (mark_step after backward and after the optimizer step only)",
}
_KEPT_STEPS = 50  # the most steps with a compilation the JSON lists one by one (the totals count them all)


def _counts(metrics, name: str) -> dict:
    return dict(metrics.metric_global(name).stats())


def _shapes_of(batch) -> list:
    """The shapes of the tensors in a batch (nested in tuples, lists and dicts), in order."""
    if isinstance(batch, torch.Tensor):
        return [list(batch.shape)]
    if isinstance(batch, dict):
        batch = list(batch.values())
    if isinstance(batch, (tuple, list)):
        return [shape for item in batch for shape in _shapes_of(item)]
    return []


def _script_line(op: str):
    """``file:line`` of the first line of the running script that calls ``op`` by its name
    (``aten::nonzero.default`` -> ``nonzero(``), or None."""
    path = script_path()
    name = op.split("::")[-1].split(".")[0].strip("_")
    if path is None or not name:
        return None
    pattern = re.compile(rf"\b_?{re.escape(name)}_?\(")
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if pattern.search(line.split("#", 1)[0]):
                return f"{os.path.basename(path)}:{number}"
    return None


class HpuSignals:
    """Reads the bridge's fallback and compilation counts at each training step's end."""

    def __init__(self, metrics, session):
        self._metrics = metrics
        self._session = session
        self.failure = None  # an error of this watcher's own: it goes silent, the run goes on
        self.steps_read = 0
        self.warmup = {"cpu_fallbacks": 0, "compilations": 0}
        self.fallback_ops: dict = {}  # op -> {"count", "steps", "first_step", "where"}, after warm-up
        self.compiled_steps: list = []  # {"step", "compilations", "micros", "shapes"} after warm-up
        self.compilations = 0  # after warm-up
        # after warm-up, in steps where autogaudi compiled: one of its trials ran, or its capture compiled
        self.own_compilations = 0
        self._trial_at_start = False  # whether a trial was running when the step under way began
        self._own_compile = False  # whether autogaudi's capture compiled in the step under way
        self.warmup_shapes = None  # the last batch's shapes during warm-up
        self._batch_shapes = None  # the shapes of the batch the step under way trained on
        self._last = self._read()
        self._handles = [
            session.events.on(Event.TRAINING_STEP, self, self._step_ended),
            session.events.on(Event.BATCH_FETCHED, self, self._batch),
        ]

    @property
    def in_force(self) -> bool:
        return self.failure is None

    def failed_at_run_time(self, error: Exception) -> None:
        self.failure = self.failure or repr(error)

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _read(self) -> dict:
        fallback, compiled = _counts(self._metrics, "cpu_fallback"), _counts(self._metrics, "graph_compilation")
        return {
            "fallbacks": fallback["TotalNumber"],
            "ops": dict(fallback["FallbackOps"]),
            "compilations": compiled["TotalNumber"],
            "micros": compiled["TotalTime"],
        }

    def compiling_for_autogaudi(self) -> None:
        self._own_compile = True

    def _batch(self, iterator, batch, waited) -> None:
        self._batch_shapes = _shapes_of(batch)

    def _step_ended(self, optimizer) -> None:
        now, before = self._read(), self._last
        self._last = now
        self.steps_read += 1
        step = self._session.steps.steps
        compiled = now["compilations"] - before["compilations"]
        running = self._session.trials.current is not None
        trial, self._trial_at_start = self._trial_at_start or running, running
        own, self._own_compile = trial or self._own_compile, False
        if step <= self._session.options.warmup_steps:
            self.warmup["cpu_fallbacks"] += now["fallbacks"] - before["fallbacks"]
            self.warmup["compilations"] += compiled
            self.warmup_shapes = self._batch_shapes or self.warmup_shapes
            return
        for op, count in now["ops"].items():
            ran = count - before["ops"].get(op, 0)
            if ran > 0:
                seen = self.fallback_ops.setdefault(
                    op, {"count": 0, "steps": 0, "first_step": step, "where": _script_line(op)}
                )
                seen["count"] += ran
                seen["steps"] += 1
        if compiled > 0 and own:
            self.own_compilations += compiled
        elif compiled > 0:
            self.compilations += compiled
            if len(self.compiled_steps) < _KEPT_STEPS:
                self.compiled_steps.append(
                    {
                        "step": step,
                        "compilations": compiled,
                        "micros": now["micros"] - before["micros"],
                        "shapes": self._batch_shapes,
                    }
                )

    def findings(self) -> list:
        """Reasons for what cost after warm-up: each op that fell back, then one per cause of the
        compilations (the shapes of the first step that compiled on them)."""
        found = [
            Reason(
                "cpu_fallback",
                REASONS,
                op=op,
                count=seen["count"],
                steps=seen["steps"],
                line=seen["where"] or "not found",
            )
            for op, seen in sorted(self.fallback_ops.items(), key=lambda item: -item[1]["count"])
        ]
        by_cause: dict = {}
        for record in self.compiled_steps:
            by_cause.setdefault(self._cause(record["shapes"]), []).append(record)
        for code, records in by_cause.items():
            shapes = records[0]["shapes"]
            count = sum(record["compilations"] for record in records)
            found.append(Reason(code, REASONS, count=count, shapes=shapes, warmup_shapes=self.warmup_shapes))
        return found

    def _cause(self, shapes) -> str:
        warm = self.warmup_shapes
        if not shapes or not warm or shapes == warm:
            return "recompiled_same_shapes"
        if len(shapes) == len(warm) and all(
            len(new) == len(old) and new[1:] == old[1:] and new[:1] < old[:1] for new, old in zip(shapes, warm)
        ):
            return "recompiled_short_batch"
        return "recompiled_new_shapes"

    def as_dict(self) -> dict:
        return {
            "steps_read": self.steps_read,
            "warmup_steps": self._session.options.warmup_steps,
            "warmup": dict(self.warmup),
            "warmup_shapes": self.warmup_shapes,
            "cpu_fallback_ops": {op: dict(seen) for op, seen in self.fallback_ops.items()},
            "compilations_after_warmup": self.compilations,
            "compilations_by_autogaudi": self.own_compilations,
            "compiled_steps": [dict(record) for record in self.compiled_steps],
            "findings": [{"code": r.code, "params": dict(r.params), "text": r.text} for r in self.findings()],
            "failure": self.failure,
        }


def short_lines(backend: dict) -> list:
    """The short report's lines for the Gaudi signals that cost after warm-up (none elsewhere)."""
    signals = (backend or {}).get("signals") or {}
    return [f"  gaudi: {finding['text']} [{finding['code']}]" for finding in signals.get("findings", ())]
