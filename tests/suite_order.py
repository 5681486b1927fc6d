"""Which lane a test is in, and how the suite is spread over pytest-xdist's workers (loaded by
pyproject's ``-p tests.suite_order``).

A test that starts an interpreter (each imports torch: seconds of CPU) is ``slow``, found from the code
rather than marked by hand: the test, the fixtures it asks for and the functions they call (the tests'
own, transitively) name ``subprocess``. The fast lane (``-m "not slow"``) is the in-process tests.

The end-to-end tests marked ``slow`` are a few percent of the tests and most of the suite's time. Run
first (their files first, each file kept in one piece), they are spread over the workers while
thousands of short tests are still queued to even out the end; run last, one of them started by a
worker whose partner has nothing left decides the wall time alone. A worker that runs out of tests
takes half of another's queue (``--dist worksteal``) unless the command line names its own ``--dist``.
"""

import ast
import inspect
import os
import sys
import textwrap

import pytest

STARTS_PROCESSES = {"subprocess"}  # a function that names it starts an interpreter (or may)


def starts_interpreters(function, seen=None) -> bool:
    """Whether ``function`` names ``subprocess``, or calls a function of the tests' own that does."""
    seen = set() if seen is None else seen
    if function in seen:
        return False
    seen.add(function)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    if names & STARTS_PROCESSES:
        return True
    module = sys.modules.get(getattr(function, "__module__", None) or "")
    called = (getattr(module, name, None) for name in names)
    return any(
        inspect.isfunction(value) and value.__module__.startswith("tests") and starts_interpreters(value, seen)
        for value in called
    )


def mark_the_slow_lane(items) -> None:
    """Every test that starts an interpreter (its own code, its fixtures', what they call) marked
    ``slow``: called by tests/conftest.py's collection hook, which runs before ``-m`` selects."""
    for item in items:
        functions = [getattr(item, "function", None)]
        for definitions in getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}).values():
            functions.extend(definition.func for definition in definitions)
        if item.get_closest_marker("slow") is None and any(
            function is not None and starts_interpreters(function) for function in functions
        ):
            item.add_marker(pytest.mark.slow)


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
