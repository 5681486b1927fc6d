"""Mixed precision (bf16, fp16 with loss scaling, CUDA TF32), used only after it matched float32 on
the run's own steps: the unit's decisions in :mod:`.unit`, its mechanisms beside it (:mod:`.guard`,
:mod:`.loss_scale`)."""

from autogaudi.optimizations.mixed_precision.unit import MixedPrecision

__all__ = ["MixedPrecision"]
