"""HPU: ``clip_grad_norm_`` (L2) through hpex ``FusedClipNorm``, built once per parameter set.

Why: the stock implementation computes one norm per gradient tensor and then scales each one, many
small ops; ``FusedClipNorm.clip_norm`` does it in one fused op (optimum-habana's
``use_fused_clip_norm``). The return value is the same: the total norm, as a tensor.
Only calls it can serve exactly are routed: ``norm_type`` 2 (FusedClipNorm has no other),
``error_if_nonfinite=False``, no explicit ``foreach``, and no DTensor among the parameters (FSDP2's
shards: torch's own takes the norm over every rank, FusedClipNorm would take this rank's); any other
call runs torch's own.
CUDA and CPU: skipped, torch's own ``clip_grad_norm_`` already runs its foreach kernels.
Both public spellings are patched; a reference bound before autogaudi started
(``from torch.nn.utils import clip_grad_norm_`` at the top of a script imported earlier) keeps
torch's version.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from autogaudi.engines import holds_dtensors
from autogaudi.unit import ROUNDING, Unit

_MAX_CACHED_SETS = 8


class FusedClipNormUnit(Unit):
    numerics = (ROUNDING,)  # the norm summed in one fused op (by reading)
    reasons = {"hpex": "hpex FusedClipNorm"}
    changed_figure = ("fused_calls", "{} clip_grad_norm_ calls through FusedClipNorm")
    targets = ("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_norm_")
    backends = ("hpu",)
    why_not_elsewhere = "torch's clip_grad_norm_ already runs its foreach kernels there"

    def apply(self) -> None:
        original = torch.nn.utils.clip_grad.clip_grad_norm_
        self._signature = inspect.signature(original)
        self._clippers = {}  # (parameter ids, max_norm) -> (parameters, clip)
        self.figures.update(fused_calls=0, torch_calls=0)
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
            if owner.clip_grad_norm_ is original:
                self.wrap(owner, "clip_grad_norm_", self._clip)
        self.because("hpex")

    def _clip(self, wrapped, instance, args, kwargs):
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        call = bound.arguments
        parameters = call["parameters"]
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        call["parameters"] = parameters  # a generator can only be read once
        wrapped.read_as(**call)
        exact = float(call["norm_type"]) == 2.0 and not call["error_if_nonfinite"] and call.get("foreach") is None
        if not exact or holds_dtensors(parameters):
            self.figures["torch_calls"] += 1
            return wrapped(**call)
        total = self._clipper(parameters, float(call["max_norm"]))(parameters)
        self.figures["fused_calls"] += 1
        return total

    def _clipper(self, parameters, max_norm: float):
        key = (tuple(id(p) for p in parameters), max_norm)
        cached = self._clippers.get(key)
        if cached is None:
            if len(self._clippers) >= _MAX_CACHED_SETS:
                self._clippers.pop(next(iter(self._clippers)))
            # The parameters are kept with the clipper so their ids cannot be reused meanwhile.
            cached = self._clippers[key] = (parameters, self.backend.fused_clip_norm(parameters, max_norm))
        return cached[1]
