"""The suite's spread over xdist's workers (tests/suite_order.py): slow tests first, work stealing unless
the command line names its own ``--dist``."""

import types

from tests import suite_order


def item(name, slow=False):
    marked = {"slow"} if slow else set()
    return types.SimpleNamespace(name=name, get_closest_marker=lambda mark: object() if mark in marked else None)


def test_slow_tests_go_first_and_the_rest_keep_their_order():
    items = [item("a"), item("b", slow=True), item("c"), item("d", slow=True)]
    suite_order.pytest_collection_modifyitems(items)
    assert [each.name for each in items] == ["b", "d", "a", "c"]


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
