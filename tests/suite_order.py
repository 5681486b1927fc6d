"""How the suite is spread over pytest-xdist's workers (loaded by pyproject's ``-p tests.suite_order``).

The end-to-end tests marked ``slow`` are a few percent of the tests and most of the suite's time. Run
first (their files first, each file kept in one piece), they are spread over the workers while
thousands of short tests are still queued to even out the end; run last, one of them started by a
worker whose partner has nothing left decides the wall time alone. A worker that runs out of tests
takes half of another's queue (``--dist worksteal``) unless the command line names its own ``--dist``.
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
    """The files that hold slow tests first, each file's slow tests first in it; otherwise pytest's order.
    A file stays in one piece, so that a module-scoped fixture its slow and quick tests share runs once."""
    slow = {item.nodeid: item.get_closest_marker("slow") is not None for item in items}
    files = [item.nodeid.split("::")[0] for item in items]
    with_slow = {file for file, item in zip(files, items) if slow[item.nodeid]}
    first_seen = {file: index for index, file in reversed(list(enumerate(files)))}
    order = {
        item.nodeid: (file not in with_slow, first_seen[file], not slow[item.nodeid])
        for file, item in zip(files, items)
    }
    items.sort(key=lambda item: order[item.nodeid])
