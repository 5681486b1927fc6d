"""The CPU backend: always available; memory figures are this process's resident memory."""

from __future__ import annotations

import contextlib
import os
import platform
import threading

from autogaudi.backends.base import Backend, MemoryStats
from autogaudi.measure import machine_load


class CpuBackend(Backend):
    name = "cpu"
    device_type = "cpu"
    # A block's graph built as one C++ file per graph (cpp_wrapper) instead of one per kernel, in this
    # process: a cold compile is mostly g++ builds of about a second each, and the C++ wrapper also
    # calls the block with less Python per step. In-process (one compile thread) because the pool's
    # workers cannot split one file and cost their start and shutdown. For a whole model's larger
    # graphs one file builds for longer than the pool builds its kernels, so only regions take it
    # (measurements: docs/units/graph_capture.md).
    region_compile_options = {"cpp_wrapper": True, "compile_threads": 1}

    def device_name(self) -> str:
        cores = machine_load.physical_cores()
        return f"{platform.machine() or 'cpu'} CPU, {cores} cores"

    def device_key(self) -> str:
        """The machine's logical CPUs, not its physical cores: as stable a key, without psutil's import
        (8 ms, at the first step that reads the cache, in every run that did not need psutil)."""
        return f"{platform.machine() or 'cpu'} CPU, {os.cpu_count()} logical CPUs"

    def graph_forward(self, module, exact_random: bool = False, static_outputs: bool = True):
        start_vector_isa_check()
        return super().graph_forward(module, exact_random=exact_random, static_outputs=static_outputs)

    def graph_blocks(self, exact_random: bool = False):
        start_vector_isa_check()
        return super().graph_blocks(exact_random)

    def memory_stats(self):
        import resource  # here, as psutil: read for the report only, never at start

        import psutil

        resident = psutil.Process().memory_info().rss
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return MemoryStats(resident, max(resident, peak), psutil.virtual_memory().total)


def start_vector_isa_check() -> None:
    """Start inductor's check of which vector instructions its C++ kernels may use, in a thread beside
    the trace that comes first. The check builds and loads a test program (4.4 s on the 2-core CPU
    with an empty inductor cache), and inductor runs it when it first generates code, after Dynamo and
    AOTAutograd have traced: there it waits for it. Mostly a subprocess, it overlaps the trace. Its
    result is torch's own (cached once per process), so nothing differs but when it is paid. What the
    check imports is imported here first (the compile imports it too), so that the thread imports
    nothing while the trace does."""
    import torch.utils.cpp_extension  # noqa: F401
    from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401

    threading.Thread(target=_vector_isa_list, args=(cpu_vec_isa,), name="autogaudi-vec-isa", daemon=True).start()


def _vector_isa_list(cpu_vec_isa) -> None:
    # torch raises here what it raises in its own call later; nothing of it is autogaudi's to report
    with contextlib.suppress(Exception):
        cpu_vec_isa.valid_vec_isa_list()


def probe():
    return CpuBackend("always available")
