"""What graph_forward builds is released with it: compile workers its compile started are shut
down, the script's own are left running."""

import psutil
import pytest
from torch import nn

from autogaudi.backends.cpu import CpuBackend


def worker_processes() -> int:
    """Inductor's compile workers under this process: not every child (an earlier test in the same
    worker may leave a pre-started interpreter running beside it)."""
    return sum(map(_is_compile_worker, psutil.Process().children(recursive=True)))


def _is_compile_worker(process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE and "compile_worker" in " ".join(process.cmdline())
    except psutil.Error:  # gone since it was listed
        return False


@pytest.fixture
def async_compile():
    import torch._inductor.async_compile as module

    module.shutdown_compile_workers()
    yield module
    module.shutdown_compile_workers()


@pytest.mark.parametrize("the_scripts_own", [False, True], ids=["started-by-autogaudi", "started-before"])
def test_compile_workers_go_with_the_graphs_only_when_autogaudis_compile_started_them(async_compile, the_scripts_own):
    if the_scripts_own:
        async_compile.AsyncCompile.process_pool()
    backend = CpuBackend("test")
    graphed = backend.graph_forward(nn.Linear(4, 4))
    async_compile.AsyncCompile.process_pool()  # what a compile wanting parallel workers does
    assert worker_processes() >= 1
    backend.release_graphs(graphed)
    assert bool(async_compile._pool_set) is the_scripts_own
    assert (worker_processes() >= 1) is the_scripts_own
