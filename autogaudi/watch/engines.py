"""Which distributed engine owns a model, for units that must keep their hands off it.

FSDP2 (``fully_shard``) replaces a module's parameters with sharded DTensors and gathers them in
hooks around each forward and backward; a unit that swaps the module's forward, its parameters or
its optimizer's kernels works on shards, not on the model it measured. DDP keeps whole parameters
and reduces gradients in its own hooks. Neither check imports anything: a model can only be
FSDP2-managed, or hold DTensors, once the script has imported those packages itself.
"""

from __future__ import annotations

import sys


def fsdp2_managed(module) -> bool:
    """True if FSDP2 owns ``module``: it is an ``FSDPModule`` (``fully_shard`` was applied to it), or
    any of its parameters is a DTensor (``fully_shard`` on its blocks only, or tensor parallelism)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(module, fsdp.FSDPModule):
        return True
    return holds_dtensors(module.parameters())


def holds_dtensors(tensors) -> bool:
    """True if any of ``tensors`` is a DTensor (a shard of a tensor spread over ranks)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and any(isinstance(value, tensor.DTensor) for value in tensors)


def ddp_wrapped(module) -> bool:
    """True if ``module`` is a ``DistributedDataParallel`` wrapper (its model is ``module.module``)."""
    parallel = sys.modules.get("torch.nn.parallel")
    return parallel is not None and isinstance(module, parallel.DistributedDataParallel)
