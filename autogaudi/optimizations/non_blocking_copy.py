"""Host-to-accelerator copies of pinned tensors with ``non_blocking=True``.

Why: a blocking copy makes the host wait for the transfer before it can queue the next op; from
pinned (page-locked) memory the copy can run asynchronously while the host keeps issuing work
(optimum-habana's ``non_blocking_data_copy``, the HF guide's pinned-memory advice).
Only ``tensor.to(accelerator)`` / ``tensor.cuda()`` of a pinned CPU tensor is changed, and only when
the call did not say ``non_blocking`` itself. Device-to-host copies are never touched: reading the
result of an unfinished copy would return garbage. The one semantic cost: the source tensor must
not be modified in place on the host right after the copy (batches from a DataLoader never are).
CPU-only runs: skipped, there is no host-to-device copy.
"""

from __future__ import annotations

import torch

from autogaudi.core.unit import Unit, UnitSpec


def target_device_type(args, kwargs):
    """The device type a ``Tensor.to`` call moves to, or None (dtype-only, tensor-like, ambiguous)."""
    device = kwargs.get("device", args[0] if args else None)
    if isinstance(device, str):
        return torch.device(device).type
    if isinstance(device, torch.device):
        return device.type
    return None


def wants_non_blocking(tensor, args, kwargs, accelerator: str) -> bool:
    """True when this ``tensor.to(...)`` call is a host-to-``accelerator`` copy of pinned memory
    that did not choose ``non_blocking`` itself (positionally: ``to(device, dtype, non_blocking)``)."""
    if "non_blocking" in kwargs or len(args) > 2 or (len(args) == 2 and not isinstance(args[1], torch.dtype)):
        return False
    return target_device_type(args, kwargs) == accelerator and tensor.device.type == "cpu" and tensor.is_pinned()


class NonBlockingCopy(Unit):
    spec = UnitSpec(
        reasons={"pinned_to_device": "pinned host tensors to {device}"},
        changed_figure=("non_blocking_copies", "{} host-to-device copies made non-blocking"),
        targets=("torch.Tensor.to",),
        acts_on=("CUDA: torch.Tensor.cuda",),
        acts_for_device=True,
    )

    def apply(self) -> None:
        self.report.figures["non_blocking_copies"] = 0
        self._accelerator = self.run.backend.device_type
        self.scope.wrap(torch.Tensor, "to", self._to)
        if self._accelerator == "cuda":
            self.scope.wrap(torch.Tensor, "cuda", self._cuda)
        self.report.because("pinned_to_device", device=self._accelerator)

    def _to(self, wrapped, instance, args, kwargs):
        if wants_non_blocking(instance, args, kwargs, self._accelerator):
            self.report.figures["non_blocking_copies"] += 1
            kwargs = {**kwargs, "non_blocking": True}
        return wrapped(*args, **kwargs)

    def _cuda(self, wrapped, instance, args, kwargs):
        if "non_blocking" not in kwargs and len(args) < 2 and instance.device.type == "cpu" and instance.is_pinned():
            self.report.figures["non_blocking_copies"] += 1
            kwargs = {**kwargs, "non_blocking": True}
        return wrapped(*args, **kwargs)
