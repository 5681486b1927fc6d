"""channels_last memory format for convolutional models, kept only when a trial measured it faster.

Why: the HF single-GPU guide recommends ``torch.channels_last`` for convolutions: NHWC lets the
convolution and BatchNorm kernels run without layout conversions (measured 1.18x on a small CNN on
this project's 2-core CPU). But it is not always faster (depthwise convolutions, tiny images, some
CPU kernels), so it goes through a trial in the user's run: the training model (found by the step
profiler) and its 4-D inputs switch between the two formats between steps and the faster is kept.

How: ``model.to(memory_format=...)`` converts parameters in place (the Parameter objects, and so
the optimizer's references, stay the same), and the optimizer's per-parameter buffers (momentum,
Adam moments) are converted with them; the inputs layer of the model's call route
(:mod:`autogaudi.model_call`, nothing of it travels with the model) converts 4-D tensor inputs. The
math is the same, up to float reassociation in the kernels; ``state_dict`` tensors are ordinary
tensors in either format and load into a plain model. A trial that is not kept, and revert, convert
the model back and take the layer off. Models with no Conv2d, and models the script already
put in channels_last, are left alone, and so is a model whose capture layer is held (captured or on
trial): compiled graphs assert the strides they were built for, and switching the format under them
crashed compiled backward passes on CUDA (docs/units/channels_last.md).
"""

from __future__ import annotations

import torch

from autogaudi.engines import fsdp2_managed
from autogaudi.events import Event
from autogaudi.model_call import Layer, holder
from autogaudi.unit import ROUNDING, ActsOnProfile


def _convert(value):
    if isinstance(value, torch.Tensor) and value.dim() == 4:
        return value.contiguous(memory_format=torch.channels_last)
    return value


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


class ChannelsLast(ActsOnProfile):
    numerics = (ROUNDING,)  # NHWC kernels sum in another order; a rejected trial ran its steps in it
    after = ("graph_capture",)  # decides first on a profile: a model it holds keeps its format
    reasons = {
        "no_conv2d": "no Conv2d in the training model",
        "already_channels_last": "left as is: the script already put the model in channels_last",
        "input_bound": "not tried: the step is input-bound ({why}); a trial would time the loader",
        "captured": "stepped aside: {holder} captures this model, and its graphs fix the memory format",
        "fsdp2": "left as is: FSDP2 shards this model's parameters and owns their layout",
        "switched_on": "{model} in channels_last (without a trial)",
        "trial_running": "trial running on {model}",
        "measured_faster": "{model} in channels_last: measured faster",
        "rejected": "rejected: {model} kept as is, not faster",
    }
    acts_on = ("<training model> parameters (memory format)", "<training model> call route, inputs layer (4-D inputs)")

    def apply(self) -> None:
        self._model = None
        self._optimizer = None
        self._candidate = None
        self._on = False
        self.on_revert(self._release)
        self.because("waiting_for_profile")
        self.on(Event.STEP_PROFILED, self._profiled)

    def _profiled(self, profile) -> None:
        model = profile.model
        if model is None:
            self.because("no_training_model")
            return
        if not any(isinstance(m, torch.nn.Conv2d) for m in model.modules()):
            self.because("no_conv2d")
            return
        if in_channels_last(model):
            self.because("already_channels_last")
            return
        if fsdp2_managed(model):
            self.because("fsdp2")
            return
        if profile.bound == "input" and self.name not in (*self.options.force, *self.options.trial):
            # Both arms would mostly time the wait for data: a trial measured 0.42x for channels_last
            # on ResNet-18 waiting 68% of each step for its loader (H100).
            self.because("input_bound", why=profile.why)
            return
        capture = holder(model, Layer.CAPTURE)
        if capture is not None:
            # Compiled graphs fix the strides they were built for: a later switch of format crashed
            # inductor's compiled backward (stride assertion) on CUDA in the siamese and mnist scripts.
            self.because("captured", holder=capture.name)
            return
        remembered = self.recalled_trial()
        if remembered is not None:
            if remembered["decision"] == "kept":
                self._set_up(profile)
            self.follow(remembered, self._switch, self._release, lambda: self._try(profile))
        else:
            self._try(profile)

    def _set_up(self, profile) -> None:
        """Hold the model and optimizer, and the inputs layer of its call, in a scope :meth:`_release` closes."""
        self._model = profile.model
        self._optimizer = profile.optimizer
        self._candidate = self.scope.child()
        self._candidate.add(lambda: self._switch(False))
        self.hold(self._model, Layer.INPUTS, self._inputs, self._candidate)

    def _try(self, profile) -> None:
        if self._candidate is None:
            self._set_up(profile)
        model = type(self._model).__name__
        if self.switch_on_or_try(self._switch, self._decided):
            self.because("switched_on", model=model)
        else:
            self.because("trial_running", model=model)

    def changes(self) -> list:
        if not (self._on and self._model is not None):
            return []
        measured = f", {self.figures['speedup']}x per step in {self.trial_named()}" if "speedup" in self.figures else ""
        return [f"{type(self._model).__name__} and its 4-D inputs in channels_last{measured}"]

    def _switch(self, on: bool) -> None:
        if on != self._on:
            self._on = on
            to_memory_format(self._model, self._optimizer, torch.channels_last if on else torch.contiguous_format)

    def _decided(self, keep: bool, record: dict) -> None:
        self.figures["speedup"] = record["speedup"]
        self.because("measured_faster" if keep else "rejected", model=type(self._model).__name__)
        if not keep:
            self._release()

    def _release(self) -> None:
        """Back to the model's own format, hook removed, no reference to the model or optimizer kept."""
        self.close_scope(self._candidate)
        self._candidate = None
        self._model = self._optimizer = None

    def _inputs(self, call, args, kwargs):
        if self._on:
            args, kwargs = tuple(map(_convert, args)), {key: _convert(value) for key, value in kwargs.items()}
        return call(*args, **kwargs)
