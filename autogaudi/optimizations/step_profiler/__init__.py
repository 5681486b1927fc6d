"""Where a training step's time goes — host, device or input — measured on a sampled window.

Why: the Gaudi guide's first rule is to profile the host: when the device waits for the host to
issue work (host-bound), graph capture removes that wait; when the device is the bottleneck it buys
nothing and costs compile time. The unit's sampling and what it publishes in :mod:`.unit`; the
census steps' observers in :mod:`.census`, the classification in :mod:`.classification`, the
training model and its inputs in :mod:`.training_model`, the published result in :mod:`.profile`.
"""

from autogaudi.optimizations.step_profiler.census import new_census, thread_clock
from autogaudi.optimizations.step_profiler.classification import (
    DECIDING_PAIRS,
    PAIRS,
    census_figures,
    classify,
    pair_shares,
    settled,
)
from autogaudi.optimizations.step_profiler.profile import StepFigures, StepProfile
from autogaudi.optimizations.step_profiler.training_model import input_shapes
from autogaudi.optimizations.step_profiler.unit import FP32_MATRIX_SHARE, StepProfiler

__all__ = [
    "DECIDING_PAIRS",
    "FP32_MATRIX_SHARE",
    "PAIRS",
    "StepFigures",
    "StepProfile",
    "StepProfiler",
    "census_figures",
    "classify",
    "input_shapes",
    "new_census",
    "pair_shares",
    "settled",
    "thread_clock",
]
