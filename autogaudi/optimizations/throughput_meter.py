"""Steps/s and samples/s after warm-up, a progress line every ``--log-every`` steps, and memory.

Why: speed claims need a figure taken on the user's own run. The clock is read at optimizer-step
boundaries only and the device is synchronised only when a progress line is printed, so measuring
adds no per-step host-device sync. Samples are counted from the batches DataLoaders yield (the
leading dimension of the first tensor in each batch); the first ``--warmup-steps`` steps are left
out, as compilation and caches make them unrepresentative. Only rank 0 prints.
"""

from __future__ import annotations

import torch

from autogaudi.core.events import Event
from autogaudi.core.unit import Unit, UnitSpec, warn
from autogaudi.entry.ranks import is_rank_zero


def leading_dimension(batch):
    """The batch size of a collated batch: the first tensor's first dimension, or None."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else None
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for item in items:
        size = leading_dimension(item)
        if size is not None:
            return size
    return None


class ThroughputMeter(Unit):
    spec = UnitSpec(
        reasons={
            "progress": "progress every {every} steps",
            "final_only": "final figures only (--log-every N for progress)",
        },
        acts_on=("training steps and batch fetches (the session's step watcher)",),
    )

    def apply(self) -> None:
        self._timed_samples = 0
        self.scope.on(Event.BATCH_FETCHED, self._count)
        self.scope.on(Event.TRAINING_STEP, self._after_step)
        every = self.run.options.log_every
        self.report.because("progress", every=every) if every else self.report.because("final_only")

    def _count(self, _iterator, batch, _waited) -> None:
        if self.run.steps.warmed_up:
            self._timed_samples += leading_dimension(batch) or 0

    def _after_step(self, _optimizer) -> None:
        timed = self.run.steps.timed
        if timed and self._timed_samples:
            self.report.figures["samples_per_s"] = round(self._timed_samples / timed[1], 1)
        every = self.run.options.log_every
        if every and self.run.steps.steps % every == 0 and is_rank_zero():
            self._log_progress()

    def _log_progress(self) -> None:
        # The only place that waits for the device, and only every `log_every` steps.
        self.run.backend.synchronize()
        figures = self.run.steps.figures()
        line = f"step {figures['steps']}"
        if "steps_per_s" in figures:
            line += f" | {figures['steps_per_s']:.2f} steps/s"
        if "samples_per_s" in self.report.figures:
            line += f" | {self.report.figures['samples_per_s']:.1f} samples/s"
        memory = self.run.backend.memory_stats()
        if memory:
            line += f" | {memory.format()}"
        warn(line)
