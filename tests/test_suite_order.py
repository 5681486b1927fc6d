"""The suite's spread over xdist's workers (tests/suite_order.py): slow tests first, work stealing unless
the command line names its own ``--dist``."""

import types

from tests import suite_order
from tests.helpers import run_python


def item(nodeid, slow=False):
    marked = {"slow"} if slow else set()
    return types.SimpleNamespace(nodeid=nodeid, get_closest_marker=lambda mark: object() if mark in marked else None)


def test_files_with_slow_tests_go_first_whole_with_their_slow_tests_first_and_the_rest_keep_their_order():
    items = [
        item("a.py::quick"),
        item("b.py::quick"),
        item("b.py::slow", slow=True),
        item("c.py::quick"),
        item("d.py::slow", slow=True),
        item("d.py::quick"),
    ]
    suite_order.pytest_collection_modifyitems(items)
    assert [each.nodeid for each in items] == [
        "b.py::slow",
        "b.py::quick",
        "d.py::slow",
        "d.py::quick",
        "a.py::quick",
        "c.py::quick",
    ]


def config(dist, *args):
    option, invocation = types.SimpleNamespace(dist=dist), types.SimpleNamespace(args=args)
    return types.SimpleNamespace(option=option, invocation_params=invocation)


def test_workers_steal_unless_the_command_line_chose_a_distribution(monkeypatch):
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
    for dist, args, expected in [
        ("load", ("-n", "2"), "worksteal"),  # xdist's default for -n N
        ("load", ("-n", "2", "--dist", "load"), "load"),
        ("load", ("-n", "2", "--dist=load"), "load"),
        ("no", ("-n", "0"), "no"),
        ("loadscope", ("--dist", "loadscope"), "loadscope"),
    ]:
        chosen = config(dist, *args)
        suite_order.pytest_configure(chosen)
        assert chosen.option.dist == expected, args
    monkeypatch.setenv("PYTEST_ADDOPTS", "--dist load")
    chosen = config("load", "-n", "2")
    suite_order.pytest_configure(chosen)
    assert chosen.option.dist == "load"


def _starts_through_a_helper():
    return run_python("-c", "pass")


def _in_process():
    return sum(range(3))


def test_a_test_that_starts_an_interpreter_is_in_the_slow_lane_found_from_its_code():
    """Directly (``subprocess``), through the tests' own helper (``run_python``), or through a function
    of this module that calls it; an in-process function is not."""
    assert suite_order.starts_interpreters(run_python)
    assert suite_order.starts_interpreters(_starts_through_a_helper)
    assert not suite_order.starts_interpreters(_in_process)


def test_the_collected_fast_lane_holds_no_test_that_runs_a_script(request):
    """Every collected test whose own code names ``run_python`` is marked slow."""
    for item in request.session.items:
        function = getattr(item, "function", None)
        if function is not None and "run_python" in function.__code__.co_names:
            assert item.get_closest_marker("slow") is not None, item.nodeid
