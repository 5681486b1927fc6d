"""Shared fixtures: subprocess runner, the HPU test double, one intra-op thread, and a guaranteed
disable() after each test."""

import compileall
import importlib
import sys

import pytest
import torch

import autogaudi
from autogaudi.measure import clock as measure_clock
from autogaudi.measure import machine_load
from autogaudi.optimizations.step_profiler import census
from autogaudi.watch import placement
from tests import prestarted
from tests.helpers import HPU_DOUBLE, REPO, SimulatedClock
from tests.suite_order import mark_the_slow_lane

# Test files that read torch's own thread count: loader_workers cuts it while its workers run, which
# it cannot where the count is already one. They run with the machine's count.
MACHINE_THREADS = {"test_loader_workers.py"}


def pytest_configure(config):
    config.addinivalue_line("markers", "machine_threads: runs with torch's own intra-op thread count, not one")
    if not hasattr(config, "workerinput"):  # once, in pytest-xdist's controller or a serial run
        # The end-to-end tests start processes that import autogaudi (some the HPU double): its
        # bytecode compiled once here, as an installed package has it, not again in every one of
        # them where none is written (PYTHONDONTWRITEBYTECODE with an editable install: 0.3 s each).
        for folder in (REPO / "autogaudi", HPU_DOUBLE):
            compileall.compile_dir(folder, quiet=1)


def pytest_unconfigure(config):
    prestarted.close_all()  # this process's pre-started interpreters (tests/prestarted.py), if it started any


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_the_slow_lane(items)
    for item in items:
        if item.path.name in MACHINE_THREADS:
            item.add_marker(pytest.mark.machine_threads)


@pytest.fixture(autouse=True)
def autogaudi_disabled_after_test(monkeypatch, request):
    """Also one intra-op thread for the test's own torch calls: the tests' tensors are tiny, and two
    OpenMP threads on a 2-core machine that runs anything else wait on each other at every op (a
    slice of the contract matrix: 93 s with two, 6.6 s with one, side by side on a loaded machine)."""
    monkeypatch.setenv("AUTOGAUDI_NO_CACHE", "1")  # no decision carried from one test to the next
    # the machine's load as an idle machine's: estimates and checks read it (tests that are about the
    # load set their own); processes the tests start read the real one
    monkeypatch.setattr(machine_load, "slowdown", lambda: 1.0)
    threads = torch.get_num_threads()
    if request.node.get_closest_marker("machine_threads") is None:
        torch.set_num_threads(1)
    yield
    autogaudi.disable()
    torch.set_num_threads(threads)


def _forget_hpu_double():
    device = sys.modules.get("habana_frameworks.torch._device")
    if device is not None:
        device.uninstall()  # later tests run without the double's torch-function mode
    for name in [name for name in sys.modules if name == "habana_frameworks" or name.startswith("habana_frameworks.")]:
        del sys.modules[name]
    if hasattr(torch, "hpu"):
        delattr(torch, "hpu")
    sys.modules.pop("torch.hpu", None)


HPU_RELEASES = ("latest", "1.19")
# The release an in-process test runs under, unless it is marked ``each_hpu_release``.
IN_PROCESS_RELEASE = "latest"


def pytest_generate_tests(metafunc):
    if "hpu_double" in metafunc.fixturenames and metafunc.definition.get_closest_marker("each_hpu_release"):
        metafunc.parametrize("hpu_double", HPU_RELEASES, indirect=True)


@pytest.fixture
def hpu_double(monkeypatch, request):
    """Make the Gaudi bridge double importable; call the result to load it: ``lazy=True/False`` sets
    PT_HPU_LAZY_MODE, None keeps the modelled release's default (``HPU_DOUBLE_RELEASE``).

    One release, ``latest`` (the software as it ships): in this process the releases differ only by
    the lazy default, since autoload happens at ``import torch``, long done here. A test that names
    its mode runs the same under either, once; a test whose behaviour follows the release's default
    is marked ``each_hpu_release`` and runs once per release. The releases' start-up (autoload,
    the lazy default) is tested in the processes tests/backends/test_hpu_*.py start.

    The in-process tests run their models on the host with the HPU backend selected: where
    ``host_stands_for_device`` (the default), the session's placement takes host tensors for the
    device's, as those tests were written; the double's own HPU tensors report ``hpu`` either way.
    Returns the double's call record module (habana_frameworks.torch._calls).
    """
    release = getattr(request, "param", IN_PROCESS_RELEASE)
    monkeypatch.syspath_prepend(str(HPU_DOUBLE))
    monkeypatch.setenv("HPU_DOUBLE_RELEASE", release)

    def load(lazy=None, host_stands_for_device=True):
        _forget_hpu_double()
        if lazy is None:
            monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
        else:
            monkeypatch.setenv("PT_HPU_LAZY_MODE", "1" if lazy else "0")
        importlib.import_module("habana_frameworks.torch")
        calls = importlib.import_module("habana_frameworks.torch._calls")
        calls.reset()
        if host_stands_for_device:
            monkeypatch.setattr(placement, "device_type_of", _host_stands_for_device)
        return calls

    load.release = release
    yield load
    autogaudi.disable()
    _forget_hpu_double()


def _host_stands_for_device(tensor) -> str:
    return "hpu" if tensor.device.type == "cpu" else tensor.device.type


@pytest.fixture
def step_clock(monkeypatch):
    """The one clock every measurement reads (step boundaries, batch waits, trials' arms, the step
    profiler, loader_workers, the fused update), moved by the test (``clock.advance(seconds)``: in a
    dataset for a wait, in the loop for the host's time, in an op for compute). The thread's CPU time
    moves with it: the thread is never off the CPU."""
    clock = SimulatedClock()
    monkeypatch.setattr(measure_clock, "now", clock)
    monkeypatch.setattr(census, "thread_clock", clock)
    return clock
