"""What the profiler publishes: the step's figures and the profile other units read."""

from __future__ import annotations

import dataclasses
import weakref

import torch


@dataclasses.dataclass
class StepFigures:
    """What the profiler measured of a step, typed; :meth:`as_dict` gives them under the keys the
    report and a remembered record use (a figure not measured is left out)."""

    ms_per_step: float
    input_wait_fraction: float  # of each clean step, waiting for the DataLoader
    ops_per_step: int
    compute_fraction: float  # of each step, the ops computing (the median census pair)
    compute_fraction_range: list  # [least, most] over the census pairs
    collective_wait_fraction: float | None = None  # where collectives ran
    collectives_without_future_per_step: float | None = None  # where some had no future to wait on
    fp32_matrix_fraction: float | None = None  # where the step ran matrix products

    def as_dict(self) -> dict:
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, figures: dict) -> StepFigures:
        """From a remembered record's figures (keys it does not know are left out)."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in figures.items() if name in names})


def _weak(value):
    return None if value is None else weakref.ref(value)


class StepProfile:
    """The result: the bound, why, the figures (``measured``, a :class:`StepFigures`), the module
    that produced the step's loss (inside DDP: graphs go inside it, its hooks stay outside) and how
    often it was called per step. The model and optimizer are held weakly: the profile must not keep
    the user's objects alive."""

    def __init__(
        self,
        bound: str,
        why: str,
        measured: StepFigures,
        root,
        optimizer,
        calls_per_step: int = 1,
        inputs=(),
        remembered=None,
    ):
        self.bound = bound
        self.why = why
        self.measured = measured
        if isinstance(root, torch.nn.parallel.DistributedDataParallel):
            root = root.module
        self._model = _weak(root)
        self._optimizer = _weak(optimizer)  # the optimizer whose step ended the census step
        self.calls_per_step = calls_per_step
        self.inputs = inputs  # the shapes of the model's positional inputs in the profiled step
        self.remembered = remembered  # the record of an earlier run this profile was taken from, or None

    def as_record(self) -> dict:
        """What a later run with the same set-up, model and inputs takes as its profile."""
        return {
            "bound": self.bound,
            "why": self.why,
            "figures": self.measured.as_dict(),
            "calls_per_step": self.calls_per_step,
        }

    @property
    def model(self):
        return self._model() if self._model is not None else None

    @property
    def optimizer(self):
        return self._optimizer() if self._optimizer is not None else None
