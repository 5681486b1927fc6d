"""Which process of a distributed job this is, so that only rank 0 talks; and every rank's unit
decisions gathered for rank 0's report.

Gathering uses the process group's key-value store, never a collective: at exit some ranks may have
returned, crashed or be stuck, and a collective would then hang the ranks that are left. Each rank
sets one key; rank 0 waits for the others at most ``GATHER_TIMEOUT_S`` and names those that did not
answer. It happens before ``destroy_process_group()`` (the store goes with the group), or at exit
when the script never destroys it.
"""

from __future__ import annotations

import os
import sys

GATHER_KEY = "autogaudi/report/rank{}"
GATHER_TIMEOUT_S = 10.0


def _distributed():
    """torch.distributed with a process group up, or None (never imports torch)."""
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return distributed
    return None


def global_rank() -> int:
    """torch.distributed's rank once a process group exists, else torchrun's ``RANK``, else 0."""
    distributed = _distributed()
    if distributed is not None:
        return distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_rank_zero() -> bool:
    return global_rank() == 0


def several_ranks() -> bool:
    """A process group with more than one rank is up."""
    distributed = _distributed()
    return distributed is not None and distributed.get_world_size() > 1


def rank_zero_choice(value):
    """Rank 0's ``value`` on every rank (one small broadcast), so that all ranks take the same code
    path: a decision made per rank that changes what runs (a trial, graph capture) would leave the
    ranks waiting in different collectives, which hangs. Call it at the same step on every rank."""
    if not several_ranks():
        return value
    chosen = [value]
    _distributed().broadcast_object_list(chosen, src=0)
    return chosen[0]


def gather_from_ranks(payload: str, timeout_s: float = GATHER_TIMEOUT_S):
    """Post this rank's ``payload`` (text); on rank 0 return {rank: payload or None if it never came}.

    Returns None on other ranks, and where there is no multi-rank process group.
    """
    if not several_ranks():
        return None
    distributed = _distributed()
    return gather_through_store(
        distributed.distributed_c10d._get_default_store(),
        distributed.get_rank(),
        distributed.get_world_size(),
        payload,
        timeout_s,
    )


def gather_through_store(store, rank: int, world: int, payload: str, timeout_s: float):
    """:func:`gather_from_ranks` on a given c10d store."""
    import datetime

    store.set(GATHER_KEY.format(rank), payload)
    if rank != 0:
        return None
    keys = [GATHER_KEY.format(other) for other in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception:  # a rank did not answer in time: report the ones that did
        pass
    return {other: store.get(key).decode() if store.check([key]) else None for other, key in enumerate(keys)}
