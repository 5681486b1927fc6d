"""Gaudi lazy mode: ``mark_step()`` after every backward, every optimizer step, and every
evaluation iteration.

Why: in lazy mode the bridge only records ops until ``mark_step()``, then compiles and runs the
accumulated graph. Without marks a whole step (forward, backward and update) becomes one graph
that is rebuilt whenever anything in it changes; the Gaudi guide's rule is a mark after
``loss.backward()`` and after ``optimizer.step()``, and optimum-habana marks once per evaluation
iteration too. Evaluation iterations are recognised as DataLoader batches fetched while autograd is
off (``torch.no_grad()`` / ``inference_mode``): the mark then closes the previous iteration's graph.
Cost: none measurable beyond the marks themselves (a mark on an empty graph is a no-op, so scripts
that already mark by hand lose nothing). Eager mode (``PT_HPU_LAZY_MODE=0``) has no marks: skipped.
Covers ``loss.backward()``, ``torch.autograd.backward``, GradScaler, gradient accumulation, several
optimizers and ``step(closure)``: all go through the session's step watcher.
"""

from __future__ import annotations

import torch

from autogaudi.core.events import Event
from autogaudi.core.unit import ROUNDING, Unit, UnitSpec


class LazyModeUnit(Unit):
    """A unit that only makes sense where ops queue until ``mark_step()``: HPU lazy mode."""

    spec = UnitSpec(
        # The bridge compiles what lies between two marks as one graph and fuses within it (by reading)
        numerics=(ROUNDING,),
        exact_when="the script marks the same steps itself",
        reasons={"hpu_eager": "HPU eager mode (PT_HPU_LAZY_MODE=0) runs ops as issued; there is nothing to mark"},
        acts_for_device=True,
    )

    def skip_reason(self):
        reason = super().skip_reason()
        if reason is None and not self.run.backend.is_lazy:
            reason = self.report.reason_for("hpu_eager")
        return reason

    def mark(self, figure: str = "mark_steps") -> None:
        self.run.backend.mark_step()
        self.report.figures[figure] += 1


class StepMarks(LazyModeUnit):
    spec = LazyModeUnit.spec.but(
        reasons={**LazyModeUnit.spec.reasons, "lazy_mode": "lazy mode"},
        changed_figure=("mark_steps", "{} mark_step calls after backward and optimizer steps"),
        acts_on=("after each backward pass and optimizer step, before each batch (the session's step watcher)",),
    )

    def apply(self) -> None:
        self.report.figures.update(mark_steps=0, eval_marks=0)
        self.scope.on(Event.AFTER_BACKWARD, self._mark_training)
        self.scope.on(Event.OPTIMIZER_STEP, lambda _optimizer: self._mark_training())
        self.scope.on(Event.BEFORE_BATCH, self._before_batch)
        self.report.because("lazy_mode")

    def _mark_training(self) -> None:
        self.mark()
        steps = self.run.steps.optimizer_steps
        if steps:
            self.report.figures["marks_per_optimizer_step"] = round(self.report.figures["mark_steps"] / steps, 2)

    def _before_batch(self, _iterator) -> None:
        if not torch.is_grad_enabled():  # an evaluation loop: close the previous iteration's graph
            self.mark("eval_marks")
