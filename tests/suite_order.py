"""How the suite is spread over pytest-xdist's workers (loaded by pyproject's ``-p tests.suite_order``).

The end-to-end tests marked ``slow`` are a few percent of the tests and most of the suite's time. Run
first, they are spread over the workers while thousands of short tests are still queued to even out
the end; run last, one of them started by a worker whose partner has nothing left decides the wall
time alone. A worker that runs out of tests takes half of another's queue (``--dist worksteal``)
unless the command line names its own ``--dist``.
"""

import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # after pytest-xdist has turned ``-n N`` without a ``--dist`` into ``--dist load``, before it starts
    # its workers
    given = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
    named = any(arg.split("=")[0] in ("--dist", "--distload", "-d") for arg in given)
    if getattr(config.option, "dist", "no") == "load" and not named:
        config.option.dist = "worksteal"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Slow tests first; otherwise the order pytest gave (a stable sort keeps each module together)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
