"""The session's start order: registry order, each unit after the units it requires or names in
``after``; and a unit whose required unit is not on is skipped, saying which."""

import pytest

import autogaudi
from autogaudi import session
from autogaudi.registry import UNIT_NAMES, UNITS


class Declared:
    def __init__(self, *requires, after=()):
        self.requires = requires
        self.after = after


def test_a_unit_starts_after_what_it_requires_and_otherwise_in_registry_order():
    units = {"graphs": Declared("profiler"), "marks": Declared(), "profiler": Declared("marks"), "off": None}
    assert session.start_order(units) == ["marks", "profiler", "graphs", "off"]
    with pytest.raises(ValueError, match="require each other"):
        session.start_order({"a": Declared("b"), "b": Declared("a")})


def test_a_unit_starts_after_the_units_it_names_without_requiring_them():
    units = {"capture": Declared(after=("precision",)), "precision": Declared(), "layout": Declared(after=("gone",))}
    assert session.start_order(units) == ["precision", "capture", "layout"]


def test_every_declared_requirement_and_order_names_a_registered_unit():
    import importlib

    for info in UNITS:
        module, name = info.module.split(":")
        unit_class = getattr(importlib.import_module(module), name)
        for needed in (*unit_class.requires, *unit_class.after):
            assert needed in UNIT_NAMES, (info.name, needed)


@pytest.mark.parametrize("unit", ["graph_capture", "channels_last"])
def test_a_unit_whose_requirement_is_off_is_skipped_naming_it(unit):
    autogaudi.enable(device="cpu", disable="step_profiler")
    row = autogaudi.report().unit(unit)
    assert (row["status"], row["reason_code"], row["reason_params"]) == (
        "skipped",
        "needs_unit",
        {"units": "step_profiler"},
    )
