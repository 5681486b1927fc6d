"""The cores a loader's workers take and the main process's intra-op threads left beside them: the
cut, with the script still reading its own number, and a forward run with a given number (to
measure the cut's rounding)."""

from __future__ import annotations

import os

import torch

from autogaudi.measure import machine_load


class ThreadCut:
    """The main process's intra-op threads, cut while workers take cores, with the script still
    reading its own number: ``torch.get_num_threads()`` gives what it set (or started with), and a
    number it sets meanwhile becomes its own, the cut applied on top (the lower of the two)."""

    def __init__(self):
        self._holders: dict = {}  # holder -> threads it needs cut to
        self._script = None  # the script's number while cut

    def install(self, scope) -> None:
        scope.wrap(torch, "get_num_threads", self._get)
        scope.wrap(torch, "set_num_threads", self._set)

    def hold(self, holder, threads: int, scope) -> None:
        """Cut to ``threads`` until ``scope`` closes."""
        if not self._holders:
            self._script = torch._C.get_num_threads()
        self._holders[holder] = threads
        self._apply()
        scope.add(lambda: self._release(holder))

    def _release(self, holder) -> None:
        self._holders.pop(holder, None)
        if not self._holders and self._script is not None:
            torch._C.set_num_threads(self._script)
            self._script = None
        elif self._holders:
            self._apply()

    def _apply(self) -> None:
        torch._C.set_num_threads(min(self._script, *self._holders.values()))

    def script_threads(self) -> int:
        """The number of intra-op threads the script set (or started with), cut or not."""
        return self._script if self._holders else torch._C.get_num_threads()

    def _get(self, wrapped, instance, args, kwargs):
        return self._script if self._holders else wrapped(*args, **kwargs)

    def _set(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)  # torch's own checks and errors, the script's number set
        if self._holders:
            self._script = torch._C.get_num_threads()
            self._apply()
        return result


def with_threads(threads: int):
    """A call (a copy's forward, a sample's build) with ``threads`` intra-op threads, torch's count put back
    after it (torch's own setter: the script's is wrapped)."""

    def forward(shadow, args, kwargs):
        before = torch._C.get_num_threads()
        torch._C.set_num_threads(threads)
        try:
            return shadow(*args, **kwargs)
        finally:
            torch._C.set_num_threads(before)

    return forward


def worker_budget():
    """(workers, main-process threads) for this machine and this process's share of it."""
    cores = machine_load.physical_cores()
    per_rank = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    workers = max(2, min(8, per_rank - 1))
    return workers, max(1, per_rank - workers)
