"""channels_last memory format for convolutional models, kept only when a trial measured it faster.

Why: the HF single-GPU guide recommends ``torch.channels_last`` for convolutions: NHWC lets the
convolution and BatchNorm kernels run without layout conversions (measured 1.18x on a small CNN on
this project's 2-core CPU). But it is not always faster (depthwise convolutions, tiny images, some
CPU kernels), so it goes through a trial in the user's run: the 4-D inputs of the training model
(found by the step profiler) switch between the two formats between steps and the faster is kept.

How: during the trial only the inputs layer of the model's call route (:mod:`autogaudi.watch.model_call`,
nothing of it travels with the model) converts 4-D tensor inputs; the kernels then run NHWC and
convert the weights per call, so the script never sees its parameters' strides change before the
decision is kept (the cost of that conversion: docs/units/channels_last.md). Once kept,
``model.to(memory_format=...)`` converts the parameters in place (the Parameter objects, and so
the optimizer's references, stay the same) and the optimizer's per-parameter buffers (momentum,
Adam moments) with them. The math is the same, up to float reassociation in the kernels;
``state_dict`` tensors are ordinary tensors in either format and load into a plain model. Revert
converts the model back and takes the layer off. Models with no Conv2d, and models the script already
put in channels_last, are left alone, and so is a model whose capture layer is held (captured or on
trial): compiled graphs assert the strides they were built for, and switching the format under them
crashed compiled backward passes on CUDA (docs/units/channels_last.md).
"""

from __future__ import annotations

import torch

from autogaudi.core.candidate import Candidate, DecidesCandidate
from autogaudi.core.events import Event
from autogaudi.core.unit import ROUNDING
from autogaudi.watch.engines import fsdp2_managed
from autogaudi.watch.model_call import Layer, holder


def _in_layout(layout, args, kwargs) -> tuple:
    """A call's arguments with its 4-D tensors in ``layout`` (the others as they are)."""

    def convert(value):
        return value.contiguous(memory_format=layout) if isinstance(value, torch.Tensor) and value.dim() == 4 else value

    return tuple(map(convert, args)), {key: convert(value) for key, value in kwargs.items()}


def in_channels_last(model) -> bool:
    """Every 4-D parameter already laid out channels_last (and not also plain contiguous: 1x1)."""
    weights = [p for p in model.parameters() if p.dim() == 4 and not p.is_contiguous()]
    return bool(weights) and all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)


def to_memory_format(model, optimizer, layout) -> None:
    """Convert ``model``'s parameters in place (the Parameter objects, and so the optimizer's
    references, stay the same) and the optimizer's per-parameter buffers of the same shape (momentum,
    Adam moments) to ``layout``: fused CUDA optimizers refuse parameters and buffers of different
    layouts (seen on an H100 with fused SGD)."""
    model.to(memory_format=layout)
    if optimizer is None:
        return
    for param in model.parameters():
        state = optimizer.state.get(param)
        if param.dim() != 4 or not state:
            continue
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                state[key] = value.contiguous(memory_format=layout)


class ChannelsLast(DecidesCandidate):
    spec = DecidesCandidate.spec.but(
        numerics=(ROUNDING,),  # NHWC kernels sum in another order; a rejected trial ran its steps in it
        after=("graph_capture",),  # decides first on a profile: a model it holds keeps its format
        reasons={
            "no_conv2d": "no Conv2d in the training model",
            "already_channels_last": "left as is: the script already put the model in channels_last",
            "input_bound": "not tried: the step is input-bound ({why}); a trial would time the loader",
            "captured": "stepped aside: {holder} captures this model, and its graphs fix the memory format",
            "fsdp2": "left as is: FSDP2 shards this model's parameters and owns their layout",
            "switched_on": "{model} in channels_last (without a trial)",
            "trial_running": "trial running on {model}",
            "measured_faster": "{model} in channels_last: measured faster",
            "rejected": "rejected: {model} kept as is, not faster",
        },
        acts_on=(
            "<training model> parameters (memory format)",
            "<training model> call route, inputs layer (4-D inputs)",
        ),
    )

    def apply(self) -> None:
        self.candidate = Candidate(self, self._set_up, lambda _on: None, self._params, kept=self._kept)
        self._numerics_pending = False
        self.report.because("waiting_for_profile")
        self.scope.on(Event.STEP_PROFILED, self._profiled)

    def _params(self) -> dict:
        return {"model": type(self.candidate.model).__name__}

    def _refusal(self, profile):
        model = profile.model
        if model is None:
            return self.report.reason_for("no_training_model")
        if not any(isinstance(m, torch.nn.Conv2d) for m in model.modules()):
            return self.report.reason_for("no_conv2d")
        if in_channels_last(model):
            return self.report.reason_for("already_channels_last")
        if fsdp2_managed(model):
            return self.report.reason_for("fsdp2")
        if profile.bound == "input" and self.name not in (*self.run.options.force, *self.run.options.trial):
            # Both arms would mostly time the wait for data: a trial measured 0.42x for channels_last
            # on ResNet-18 waiting 68% of each step for its loader (H100).
            return self.report.reason_for("input_bound", why=profile.why)
        capture = holder(model, Layer.CAPTURE)
        if capture is not None:
            # Compiled graphs fix the strides they were built for: a later switch of format crashed
            # inductor's compiled backward (stride assertion) on CUDA in the siamese and mnist scripts.
            return self.report.reason_for("captured", holder=capture.name)
        return None

    def _profiled(self, profile) -> None:
        refusal = self._refusal(profile)
        if refusal:
            self.candidate.refuse(refusal)
            return
        remembered = self.run.recalled_trial(self.name)
        if remembered is not None:
            self.candidate.follow(remembered, profile)
        else:
            self.candidate.try_(profile)

    def _set_up(self, scope) -> None:
        """The inputs layer of the model's call: while on, 4-D inputs go in channels_last and the
        kernels run NHWC; the parameters stay as the script laid them out until the decision is kept."""
        scope.hold(self.candidate.model, Layer.INPUTS, self._inputs)
        self._numerics_pending = True  # measured on the first call in channels_last

    def _kept(self, scope) -> None:
        """Kept: the parameters and the optimizer's buffers too, so that no kernel converts the
        weights per call; back to the model's own format when ``scope`` closes (released, reverted,
        or a remembered decision tried again)."""
        model, optimizer = self.candidate.model, self.candidate.optimizer
        to_memory_format(model, optimizer, torch.channels_last)
        scope.add(lambda: to_memory_format(model, optimizer, torch.contiguous_format))

    def changes(self) -> list:
        if not self.in_use():
            return []
        return [f"{type(self.candidate.model).__name__} and its 4-D inputs in channels_last{self.trial_speedup()}"]

    def _inputs(self, call, args, kwargs):
        if self.candidate.on:
            if self._numerics_pending:
                self._measure_numerics(args, kwargs)
            args, kwargs = _in_layout(torch.channels_last, args, kwargs)
        return call(*args, **kwargs)

    def _measure_numerics(self, args, kwargs) -> None:
        """Once: the model's output as kept (its parameters and 4-D inputs in channels_last) against
        contiguous, both computed on a copy of the model (the same generator state for each: the
        same dropout masks, so the figure is the kernels' rounding alone)."""
        self._numerics_pending = False
        as_kept, plain = _in_format(torch.channels_last), _in_format(torch.contiguous_format)
        self.report.measure_numerics(
            self.candidate.model,
            args,
            kwargs,
            of="outputs",
            against="contiguous parameters and inputs, on a copy of the model",
            around=as_kept,
            reference=plain,
        )


def _in_format(layout):
    """A copy's forward with its parameters and 4-D inputs in ``layout``."""

    def forward(shadow, args, kwargs):
        shadow.to(memory_format=layout)
        args, kwargs = _in_layout(layout, args, kwargs)
        return shadow(*args, **kwargs)

    return forward
