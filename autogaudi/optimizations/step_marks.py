"""Gaudi lazy mode: ``mark_step()`` right after every backward pass and every optimizer step.

Why: in lazy mode the bridge only records ops until ``mark_step()``, then compiles and runs the
accumulated graph. Without marks a whole step (forward, backward and update) becomes one graph
that is rebuilt whenever anything in it changes; the Gaudi guide's rule is a mark after
``loss.backward()`` and after ``optimizer.step()``, which keeps graphs small and cached.
Cost: none measurable beyond the marks themselves (a mark on an empty graph is a no-op, so scripts
that already mark by hand lose nothing). Eager mode (``PT_HPU_LAZY_MODE=0``) has no marks: skipped.
Covers ``loss.backward()``, ``torch.autograd.backward``, GradScaler, gradient accumulation, several
optimizers and ``step(closure)``: all go through the session's step watcher.
"""
from __future__ import annotations

from autogaudi.unit import Unit


class StepMarks(Unit):
    targets = ("torch.autograd.backward", "torch.optim.optimizer.register_optimizer_step_post_hook")
    backends = ("hpu",)

    def skip_reason(self):
        reason = super().skip_reason()
        if reason is None and not self.backend.is_lazy:
            reason = "HPU eager mode (PT_HPU_LAZY_MODE=0) runs ops as issued; there is nothing to mark"
        return reason

    def apply(self) -> None:
        self.figures["mark_steps"] = 0
        self.session.steps.after_backward(self, self._mark)
        self.session.steps.after_optimizer_step(self, lambda _optimizer: self._mark())
        self.reason = "lazy mode"

    def _mark(self) -> None:
        self.backend.mark_step()
        self.figures["mark_steps"] += 1
        steps = self.session.steps.optimizer_steps
        if steps:
            self.figures["marks_per_optimizer_step"] = round(self.figures["mark_steps"] / steps, 2)
