"""FusedClipNorm: L2 (norm_type 2.0) gradient clipping, built once for a set of parameters; in lazy
mode a step is marked before and after ``clip_norm`` (bridge ``hpex/normalization/FusedClipNorm.py``,
read 2026-11-23)."""

import torch

from habana_frameworks.torch._calls import record
from habana_frameworks.torch.core import mark_step
from habana_frameworks.torch.utils.internal import is_lazy


class FusedClipNorm:
    def __init__(self, parameters, max_norm):
        self.max_norm = float(max_norm)
        self.norm_type = 2.0
        record("FusedClipNorm", max_norm=self.max_norm)

    def clip_norm(self, parameters):
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        if is_lazy():
            mark_step()  # the bridge marks a step before clipping and after (hpex/normalization/FusedClipNorm.py)
        grads = [p.grad for p in parameters if p.grad is not None]
        record("FusedClipNorm.clip_norm", grads=len(grads))
        if not grads:
            return torch.tensor(0.0)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0)
        coefficient = torch.clamp(self.max_norm / (total + 1e-6), max=1.0)
        for grad in grads:
            grad.mul_(coefficient)
        if is_lazy():
            mark_step()
        return total
