"""Adam, AdamW and SGD as one fused kernel per step: the unit's decisions in :mod:`.unit`, its
mechanisms beside it (:mod:`.kernels`, :mod:`.hpu_format`, :mod:`.update_times`)."""

from autogaudi.optimizations.fused_optimizer.unit import FusedOptimizer

__all__ = ["FusedOptimizer"]
