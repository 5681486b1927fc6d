"""The unit contract: exact undo through wrapt, fail-open in apply() and at run time, user errors untouched."""

import importlib
import re
import types

import pytest
import torch

import autogaudi
from autogaudi.core.registry import UNITS
from autogaudi.core.status import Status
from autogaudi.core.unit import wrap_attribute
from autogaudi.optimizations.step_marks import StepMarks
from tests.helpers import SWITCHED_ON_BY


def passthrough(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def test_wrap_attribute_restores_the_identical_object():
    namespace = types.SimpleNamespace(function=lambda x: x + 1)
    module = types.ModuleType("m")
    module.function = namespace.function
    undo = wrap_attribute(module, "function", passthrough)
    assert module.function is not namespace.function and module.function(1) == 2
    assert undo() is None
    assert module.function is namespace.function


def test_wrap_attribute_on_an_inherited_method_removes_the_override():
    class Base:
        def step(self):
            return "base"

    class Child(Base):
        pass

    undo = wrap_attribute(Child, "step", lambda wrapped, instance, args, kwargs: "wrapped " + wrapped())
    assert Child().step() == "wrapped base" and "step" in vars(Child)
    undo()
    assert "step" not in vars(Child) and Child.step is Base.step


def test_a_wrapped_method_rebound_through_its_func_still_goes_through_the_wrapper():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    undo = wrap_attribute(
        torch.optim.SGD, "step", lambda wrapped, instance, args, kwargs: calls.append(instance) or wrapped()
    )
    try:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)  # rebinds optimizer.step via __func__
        model(torch.ones(2)).sum().backward()
        optimizer.step()
        scheduler.step()
    finally:
        undo()
    assert calls == [optimizer]


def test_undo_leaves_a_later_patch_alone():
    module = types.ModuleType("m")
    module.function = original = lambda: 1
    undo = wrap_attribute(module, "function", passthrough)
    module.function = theirs = lambda: 2
    note = undo()
    assert (note.code, note.params) == ("patch_replaced", {"target": "m.function"})
    assert module.function is theirs and module.function is not original


def train(steps=5, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def attention_workload(steps=4):
    """A step touching every unit's targets: attention, clip_grad_norm_, AdamW, backward, step."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = layer(torch.randn(3, 5, 16)).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(layer.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


PATCHABLE = {
    "scaled_dot_product_attention": lambda: torch.nn.functional.scaled_dot_product_attention,
    "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_,
    "AdamW.__init__": lambda: vars(torch.optim.AdamW)["__init__"],
    "backward": lambda: torch.autograd.backward,
    "Tensor.to": lambda: torch.Tensor.to,
}


@pytest.mark.parametrize("unit", [info for info in UNITS], ids=lambda info: info.name)
def test_unit_whose_apply_raises_is_reverted_and_reported(hpu_double, monkeypatch, unit):
    hpu_double(lazy=True)
    expected = attention_workload()
    originals = {name: get() for name, get in PATCHABLE.items()}
    module_name, class_name = unit.module.split(":")
    unit_class = getattr(importlib.import_module(module_name), class_name)
    real_apply = unit_class.apply

    def apply_then_raise(self):
        real_apply(self)  # patches really installed, then the failure: all of it must be undone
        raise RuntimeError("injected apply failure")

    monkeypatch.setattr(unit_class, "apply", apply_then_raise)
    # Units that act on the step profile need the profiler on too.
    options = SWITCHED_ON_BY.get(unit.name, {})
    autogaudi.enable(device="hpu", only=f"{unit.name},step_profiler", force=unit.name, **options)
    torch.testing.assert_close(attention_workload(), expected, rtol=1e-6, atol=1e-7)
    row = autogaudi.report().unit(unit.name)
    assert row["status"] == "failed"
    assert row["reason_code"] == "apply_raised"
    assert row["reason_params"] == {"error": "RuntimeError('injected apply failure')"}
    autogaudi.disable()
    still_patched = [name for name, get in PATCHABLE.items() if get() is not originals[name]]
    assert still_patched == []


def test_unit_that_breaks_at_run_time_is_reverted_and_the_run_goes_on(hpu_double, monkeypatch, capsys):
    calls = hpu_double(lazy=True)
    expected = train()
    autogaudi.enable(device="hpu", only="step_marks")
    import habana_frameworks.torch.core as htcore

    def broken_mark_step(*args, **kwargs):
        raise RuntimeError("injected run-time failure")

    monkeypatch.setattr(htcore, "mark_step", broken_mark_step)
    assert train() == expected
    row = autogaudi.report().unit("step_marks")
    assert (row["status"], row["reason_code"]) == ("failed", "failed_at_run_time")
    assert row["reason_params"]["error"] == "RuntimeError('injected run-time failure')"
    assert re.fullmatch(r"autogaudi/backends/hpu\.py:\d+ in mark_step", row["reason_params"]["where"])
    assert "step_marks raised RuntimeError('injected run-time failure')" in capsys.readouterr().err
    assert calls.names() == []  # nothing was marked after the failure


def test_user_exceptions_propagate_unchanged():
    def backward_without_grad():
        torch.ones(2).sum().backward()

    with pytest.raises(RuntimeError) as plain:
        backward_without_grad()
    autogaudi.enable()
    with pytest.raises(RuntimeError) as patched:
        backward_without_grad()
    assert type(patched.value) is type(plain.value) and str(patched.value) == str(plain.value)
    assert autogaudi.report().as_dict()["steps"]["backward_passes"] == 0


def test_units_too_new_for_this_torch_are_skipped_with_the_reason(hpu_double, monkeypatch):
    hpu_double(lazy=True)
    monkeypatch.setattr(StepMarks, "spec", StepMarks.spec.but(min_torch=(99, 0)))
    autogaudi.enable(device="hpu", only="step_marks")
    row = autogaudi.report().unit("step_marks")
    assert (row["status"], row["reason_code"]) == ("skipped", "old_torch")
    assert row["reason_params"] == {"needed": "99.0", "version": torch.__version__}


def test_the_report_and_settled_read_each_units_status(monkeypatch):
    """Sampled after every step of a run with every CPU unit on: each in-force unit's row says its
    status, and the run is settled exactly when none is deciding."""
    from autogaudi.entry import runtime

    seen = set()
    # forced: a fused optimizer is applied from its first step (timed, it decides only after 13)
    autogaudi.enable(device="cpu", force="graph_capture,fused_optimizer", warmup_steps=1)
    session = runtime._STATE.session
    for _ in range(12):
        train(steps=1)
        rows = {row["name"]: row["status"] for row in autogaudi.report().units}
        statuses = {unit.name: unit.status() for unit in session.applied}
        assert {name: rows[name] for name in statuses} == {name: status.value for name, status in statuses.items()}
        assert session.settled() is (Status.DECIDING not in statuses.values())
        seen.update(statuses.values())
    assert {Status.DECIDING, Status.APPLIED} <= seen


def test_a_unit_author_meets_at_most_twenty_public_names_on_unit():
    """A unit declares one spec and patches, speaks and reads through its scope, report and run view:
    the base class a new unit reads stays small."""
    from autogaudi.core.unit import Unit

    public = [name for name in dir(Unit) if not name.startswith("_")]
    assert len(public) <= 20, public


def test_no_unit_reaches_into_the_session():
    """What a unit reads of the run is named in its run view (autogaudi/core/run_view.py), not taken
    from the session wherever it happens to be."""
    import ast
    import pathlib

    import autogaudi.optimizations

    folder = pathlib.Path(autogaudi.optimizations.__file__).parent
    reached = {
        f"{path.relative_to(folder)}:{node.lineno}"
        for path in folder.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr in ("session", "_session")
    }
    assert not reached
