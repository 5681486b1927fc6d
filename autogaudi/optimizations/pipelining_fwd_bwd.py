"""Gaudi lazy mode, opt-in: one extra ``mark_step()`` just before the backward pass starts.

Why: the forward graph is then sent to the device while the host is still building the backward
graph, so host and device work overlap (optimum-habana's ``pipelining_fwd_bwd``).
Cost: the forward's activations are materialised on the device before backward needs them, which
raises peak device memory; that is why it is off unless asked for (``--force pipelining_fwd_bwd``).
"""

from __future__ import annotations

from autogaudi.core.events import Event
from autogaudi.optimizations.step_marks import LazyModeUnit


class PipeliningFwdBwd(LazyModeUnit):
    spec = LazyModeUnit.spec.but(
        reasons={**LazyModeUnit.spec.reasons, "forced": "lazy mode, forced on"},
        changed_figure=("mark_steps", "{} extra mark_step calls before backward"),
        acts_on=("before each backward pass (the session's step watcher)",),
    )

    def apply(self) -> None:
        self.report.figures["mark_steps"] = 0
        self.scope.on(Event.BEFORE_BACKWARD, lambda _loss: self.mark())
        self.report.because("forced")
