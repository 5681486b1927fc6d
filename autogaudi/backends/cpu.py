"""The CPU backend: always available; memory figures are this process's resident memory."""

from __future__ import annotations

import platform
import resource

import psutil

from autogaudi.backends.base import Backend, MemoryStats


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"

    def device_name(self) -> str:
        cores = psutil.cpu_count(logical=False) or psutil.cpu_count()
        return f"{platform.machine() or 'cpu'} CPU, {cores} cores"

    def memory_stats(self):
        resident = psutil.Process().memory_info().rss
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return MemoryStats(resident, max(resident, peak), psutil.virtual_memory().total)


def probe():
    return CpuBackend("always available")
