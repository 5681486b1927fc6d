"""Where the training's work runs: on the backend's device, or on the host.

Why: the backend says which accelerator exists, not where the script put its model. A script written
for CUDA (``device = "cuda" if torch.cuda.is_available() else "cpu"``) run on a Gaudi without Intel's
GPU migration trains on the CPU; units that act for the device (step marks, hpex kernels, pinning,
padded batches) would then change a CPU run for nothing, and the report would describe a Gaudi run
that never happened. So the core finds out once where the training model's parameters are, and
units that only make sense on the device (``Unit.needs_work_on_device``) step aside with the code
``model_not_on_device`` when they are not there.

When: at the earliest point the training model is known. Two points see it, whichever comes first:
an optimizer's construction (its parameters are the trained ones; fused_optimizer sees it, the
session's step watcher does not) and the first backward pass (the parameters the loss reaches
through autograd, found from ``loss.grad_fn``). A verdict is taken once; what units did before it
(a DataLoader pinned or padded at construction, an attention call in the first forward) is undone
where it can be (:meth:`Unit.step_aside`) and said where it cannot.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

# How many autograd nodes the search for a parameter visits from the loss before giving up.
_MAX_NODES = 10_000


def device_type_of(tensor: torch.Tensor) -> str:
    """The device type ``tensor`` reports, as a script would ask it (the HPU test double's tensors
    report ``hpu`` too). A module function so that tests whose models stay on the host can stand
    them for the device's."""
    return tensor.device.type


def parameters_reached(tensors) -> list:
    """Leaf tensors that require grad and that ``tensors``' autograd graphs reach (the parameters a
    backward of them trains): the first found, at most a few, searched breadth-first."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    pending = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    leaves = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is None]
    seen = set()
    while pending and len(seen) < _MAX_NODES and len(leaves) < 4:
        node = pending.pop(0)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: the parameter itself
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        pending.extend(following for following, _ in node.next_functions)
    return leaves


def _trained(tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.is_floating_point()


class Placement:
    """The session's verdict on where the work is: None until seen, then True (on the backend's
    device) or False (on the host while the backend is an accelerator)."""

    def __init__(self, session):
        self.session = session
        self.on_device = None
        self.seen = None  # {"device", "at"}: where the trained parameters were, and where that was seen

    def observe(self, parameters, at: str) -> None:
        """Take the verdict from ``parameters`` (the trained ones) if none was taken yet."""
        if self.on_device is not None:
            return
        backend = self.session.backend
        # FakeTensors: the memory forecast's copies, not the script's parameters
        tensors = [p for p in parameters if _trained(p) and not isinstance(p, FakeTensor)]
        if not tensors:
            return
        devices = sorted({device_type_of(t) for t in tensors})
        self.on_device = backend.device_type == "cpu" or backend.device_type in devices
        self.seen = {"device": "/".join(devices), "at": at}
        if not self.on_device:
            self.session.work_off_device(self.seen["device"], at)

    def observe_backward(self, tensors) -> None:
        if self.on_device is None:
            self.observe(parameters_reached(tensors), "first backward")

    def as_dict(self):
        if self.seen is None:
            return None
        return {**self.seen, "on_device": self.on_device}
