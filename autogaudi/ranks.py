"""Which process of a distributed job this is, so that only rank 0 talks."""
from __future__ import annotations

import os
import sys


def global_rank() -> int:
    """torch.distributed's rank once a process group exists, else torchrun's ``RANK``, else 0."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_rank_zero() -> bool:
    return global_rank() == 0
