"""Reason codes: one table gives the text and the code; unit codes never shadow the core's."""

import gc
import importlib
import weakref

import pytest

from autogaudi.core.reasons import CORE, Reason
from autogaudi.core.registry import UNITS


def unit_classes():
    for info in UNITS:
        module_name, class_name = info.module.split(":")
        yield info.name, getattr(importlib.import_module(module_name), class_name)


def test_a_reason_is_its_code_and_the_text_its_template_makes():
    error = ValueError("bad")
    reason = Reason("apply_raised", error=error)
    assert (reason.code, reason.text) == ("apply_raised", "apply() raised ValueError('bad'); reverted")
    assert reason.params == {"error": "ValueError('bad')"}  # JSON values: the exception itself is not kept


def test_a_unit_table_is_read_before_the_core():
    table = {"lazy_mode": "lazy mode, {how}"}
    assert Reason("lazy_mode", table, how="forced").text == "lazy mode, forced"
    assert Reason("old_torch", table, needed="9.0", version="2.1").code == "old_torch"


def test_an_unknown_code_names_the_known_ones():
    with pytest.raises(KeyError, match="no reason code 'no_such'.*apply_raised"):
        Reason("no_such")


@pytest.mark.parametrize("name, unit_class", list(unit_classes()))
def test_unit_codes_do_not_shadow_core_codes(name, unit_class):
    assert not set(unit_class.spec.reasons) & set(CORE), name


def test_an_exception_given_as_a_parameter_is_not_kept_with_its_frames():
    class Batch:  # what a user's frame holds when a unit fails inside its call
        pass

    batch = Batch()
    alive = weakref.ref(batch)

    def failing(held):
        raise RuntimeError("failed")

    try:
        failing(batch)
    except RuntimeError as error:
        reason = Reason("failed_at_run_time", error=error, where="here")
    del batch
    gc.collect()
    assert alive() is None and reason.params == {"error": "RuntimeError('failed')", "where": "here"}
