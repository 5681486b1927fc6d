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
Measured (``numerics_measured``): at the first fused call, torch's own total norm of the same
gradients (:func:`torch_total_norm`, read-only, before FusedClipNorm scales them) against the fused
one. The clipped gradients follow from the norm (each is scaled by ``max_norm / (norm + 1e-6)``), so
the norm's difference is the one the clipping adds; no copy of the gradients is made.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from autogaudi.core.unit import ROUNDING, Unit, UnitSpec
from autogaudi.measure import numerics
from autogaudi.watch.engines import holds_dtensors

_MAX_CACHED_SETS = 8


def torch_total_norm(parameters) -> torch.Tensor:
    """The total L2 norm of ``parameters``' gradients as torch's ``clip_grad_norm_`` computes it
    (``get_total_norm``; before torch 2.6, the norm of the per-gradient norms), read-only."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if hasattr(torch.nn.utils, "get_total_norm"):
        return torch.nn.utils.get_total_norm(grads, 2.0)
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0).to(device) for g in grads]), 2.0)


class FusedClipNormUnit(Unit):
    spec = UnitSpec(
        numerics=(ROUNDING,),  # the norm summed in one fused op (measured at the first call)
        reasons={"hpex": "hpex FusedClipNorm"},
        changed_figure=("fused_calls", "{} clip_grad_norm_ calls through FusedClipNorm"),
        targets=("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_norm_"),
        acts_for_device=True,
    )

    def apply(self) -> None:
        original = torch.nn.utils.clip_grad.clip_grad_norm_
        self._signature = inspect.signature(original)
        self._clippers = {}  # (parameter ids, max_norm) -> (parameters, clip)
        self.report.figures.update(fused_calls=0, torch_calls=0)
        self._rounding_measured = False  # at the first fused call
        for owner in (torch.nn.utils, torch.nn.utils.clip_grad):
            if owner.clip_grad_norm_ is original:
                self.scope.wrap(owner, "clip_grad_norm_", self._clip)
        self.report.because("hpex")

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
            self.report.figures["torch_calls"] += 1
            return wrapped(**call)
        # measured at the first fused call, before the fused op scales the gradients in place
        reference = None if self._rounding_measured else torch_total_norm(parameters)
        total = self._clipper(parameters, float(call["max_norm"]))(parameters)
        self.report.figures["fused_calls"] += 1
        if reference is not None:
            self._rounding_measured = True
            self.report.figures["numerics_measured"] = numerics.measured(
                numerics.largest_relative_difference([total], [reference]),
                of="total norm",
                steps=1,
                against="torch's total norm of the same gradients",
            )
        return total

    def _clipper(self, parameters, max_norm: float):
        key = (tuple(id(p) for p in parameters), max_norm)
        cached = self._clippers.get(key)
        if cached is None:
            if len(self._clippers) >= _MAX_CACHED_SETS:
                self._clippers.pop(next(iter(self._clippers)))
            # The parameters are kept with the clipper so their ids cannot be reused meanwhile.
            cached = self._clippers[key] = (parameters, self.run.backend.fused_clip_norm(parameters, max_norm))
        return cached[1]
