"""The one fail-open boundary: the guard tells the user's exception from autogaudi's, never runs a
user's call twice, switches the owner off; no unit can hand torch a callable around it; and a
deliberately broken unit, wherever it breaks, leaves the user's run as plain PyTorch's."""

import ast
import pathlib
import traceback
import weakref

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import autogaudi
from autogaudi.core import guard, session
from autogaudi.core.events import Event
from autogaudi.core.registry import UNITS, UnitInfo
from autogaudi.core.unit import ActsOnProfile
from autogaudi.watch.model_call import Layer
from tests.helpers import REPO, GuardOwner, collector_off


class Counted:
    def __init__(self, result=None, raises=None):
        self.calls = 0
        self.result = result
        self.raises = raises

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.raises is not None:
            raise self.raises
        return self.result


def test_the_users_exception_propagates_unchanged_and_the_owner_stays_on():
    owner, error = GuardOwner(), ValueError("the user's")
    users = Counted(raises=error)
    with pytest.raises(ValueError) as raised:
        guard.guarded_call(owner, lambda call, args, kwargs: call(*args, **kwargs), users, (1,), {})
    assert raised.value is error and users.calls == 1 and owner.in_force


@pytest.mark.parametrize("wrapper_replaces_it", [False, True])
def test_the_users_exception_leaves_no_cycle_that_keeps_the_callers_objects(wrapper_replaces_it):
    """A loop's StopIteration passes the guard every epoch: the caller's locals die at its return,
    by reference counting, as without the guard."""
    owner = GuardOwner()

    def wrapper(call, args, kwargs):
        try:
            return call(*args, **kwargs)
        except StopIteration:
            if wrapper_replaces_it:
                raise RuntimeError("autogaudi's") from None
            raise

    def exhausted():  # a fresh exception, as an iterator's end raises: one held would close a cycle
        raise StopIteration

    def caller():
        held = torch.zeros(3)
        try:  # not pytest.raises: what it keeps of the exception would hold this frame itself
            guard.guarded_call(owner, wrapper, exhausted, (), {})
        except StopIteration:
            return weakref.ref(held)
        raise AssertionError("the user's StopIteration did not arrive")

    with collector_off():
        assert caller()() is None


def test_autogaudi_raising_before_the_call_switches_it_off_and_the_call_runs_once():
    owner, users = GuardOwner(), Counted(result="plain")

    def broken(call, args, kwargs):
        raise RuntimeError("autogaudi's")

    assert guard.guarded_call(owner, broken, users, (), {}) == "plain"
    assert users.calls == 1 and not owner.in_force
    assert guard.guarded_call(owner, broken, users, (), {}) == "plain"  # off: straight through
    assert users.calls == 2 and len(owner.failures) == 1


def test_autogaudi_raising_after_the_call_returns_its_result_without_running_it_again():
    owner, users = GuardOwner(), Counted(result="plain")

    def broken_after(call, args, kwargs):
        call(*args, **kwargs)
        raise RuntimeError("autogaudi's")

    assert guard.guarded_call(owner, broken_after, users, (), {}) == "plain"
    assert users.calls == 1 and not owner.in_force


def test_a_wrapper_that_read_a_generator_fails_open_with_what_it_read():
    owner, seen = GuardOwner(), []

    def users(parameters):
        seen.append(list(parameters))
        return "plain"

    def reads_then_breaks(call, args, kwargs):
        parameters = list(args[0])
        call.read_as(parameters)
        raise RuntimeError("autogaudi's")

    assert guard.guarded_call(owner, reads_then_breaks, users, (iter([1, 2, 3]),), {}) == "plain"
    assert seen == [[1, 2, 3]] and not owner.in_force


def test_a_wrapper_that_replaces_the_users_exception_gives_the_users_back():
    owner, error = GuardOwner(), KeyError("the user's")

    def replacing(call, args, kwargs):
        try:
            call()
        except KeyError:
            raise RuntimeError("autogaudi's") from None

    with pytest.raises(KeyError) as raised:
        guard.guarded_call(owner, replacing, Counted(raises=error), (), {})
    assert raised.value is error and not owner.in_force


@pytest.mark.parametrize("passing", guard.PASSING_THROUGH)
def test_torchs_control_flow_exceptions_pass_and_fail_nothing(passing):
    owner = GuardOwner()

    def stopped(call, args, kwargs):
        raise passing()

    with pytest.raises(passing):
        guard.guarded_call(owner, stopped, Counted(), (), {})
    assert owner.in_force


def test_a_guarded_hook_that_raises_changes_nothing_and_interrupts_pass():
    owner = GuardOwner()
    assert guard.run_guarded(owner, Counted(raises=RuntimeError("autogaudi's")), 1) is None and not owner.in_force
    with pytest.raises(KeyboardInterrupt):
        guard.run_guarded(GuardOwner(), Counted(raises=KeyboardInterrupt()))


# -- by construction: no unit hands torch a callable around the guard ------------------------------


def unit_sources():
    return sorted((REPO / "autogaudi" / "optimizations").glob("*.py"))


@pytest.mark.parametrize("path", unit_sources(), ids=lambda path: path.name)
def test_no_unit_registers_a_torch_hook_or_sets_a_call_slot_itself(path: pathlib.Path):
    """Hooks go through ``unit.scope.hook`` (which takes the ``register_*`` method uncalled), a model's call
    through ``unit.scope.hold``: a call of a ``register_*hook`` method, or an assignment of the compiled-call
    slot, in a unit's module would bypass the guard."""
    tree = ast.parse(path.read_text(), filename=str(path))
    offending = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name.startswith("register_") and "hook" in name:
                offending.append(f"{path.name}:{node.lineno} calls {name}")
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr == "_compiled_call_impl":
                    offending.append(f"{path.name}:{node.lineno} sets _compiled_call_impl")
    assert not offending, offending


# -- a deliberately broken unit --------------------------------------------------------------------


class BrokenUnit(ActsOnProfile):
    """Breaks where the test says: a wrapper around a torch function, a layer of the model's call
    (before or after the call), a hook on the loss, or a listener."""

    where = None
    spec = ActsOnProfile.spec.but(reasons={"broken": "breaks at {where}"})

    def apply(self):
        self.report.because("broken", where=self.where)
        if self.where == "wrapper":
            self.scope.wrap(torch.nn.functional, "relu", self._broken_wrapper)
        if self.where == "listener":
            self.scope.on(Event.OPTIMIZER_STEP, self._raise)
        if self.where == "loss_hook":
            self.scope.on(Event.BEFORE_BACKWARD, lambda loss: self.scope.hook(loss.register_hook, self._raise))
        self.scope.on(Event.STEP_PROFILED, self._profiled)

    def _profiled(self, profile):
        if self.where in ("layer_before", "layer_after"):
            self.scope.hold(profile.model, Layer.INPUTS, self._broken_layer)

    def _broken_wrapper(self, wrapped, instance, args, kwargs):
        raise RuntimeError("broken wrapper")

    def _broken_layer(self, call, args, kwargs):
        if self.where == "layer_before":
            raise RuntimeError("broken before the call")
        call(*args, **kwargs)
        raise RuntimeError("broken after the call")

    def _raise(self, *args):
        raise RuntimeError(f"broken {self.where}")


def losses(steps=25):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(steps):
        inputs = torch.randn(4, 8, generator=generator)
        loss = nn.functional.cross_entropy(torch.nn.functional.relu(model(inputs)), torch.zeros(4, dtype=torch.long))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append(loss.item())
    return seen


@pytest.mark.parametrize("where", ["wrapper", "layer_before", "layer_after", "loss_hook", "listener"])
def test_a_broken_unit_leaves_the_run_plain_and_its_row_failed(monkeypatch, where):
    monkeypatch.setattr(BrokenUnit, "where", where)
    monkeypatch.setattr(
        session, "UNITS", (*session.UNITS, UnitInfo("broken", "breaks", "tests.core.test_guard:BrokenUnit"))
    )
    relu, plain = torch.nn.functional.relu, losses()
    others = [info.name for info in UNITS if info.name != "step_profiler"]
    autogaudi.enable(device="cpu", disable=",".join(others))
    assert autogaudi.report().unit("broken")["status"] == "watching"
    assert losses() == plain
    row = autogaudi.report().unit("broken")
    assert (row["status"], row["reason_code"]) == ("failed", "failed_at_run_time"), row
    assert row["reason_params"]["error"].startswith("RuntimeError('broken")
    assert torch.nn.functional.relu is relu  # reverted: the plain function again


@pytest.mark.parametrize("error", [KeyboardInterrupt, ValueError])
def test_the_users_exception_leaves_with_none_of_autogaudis_frames(error):
    """A Ctrl-C or the user's error, through a wrapper: its traceback reads as without the wrapper."""

    def users_call():
        raise error

    with pytest.raises(error) as caught:
        guard.guarded_method_call(GuardOwner(), lambda call, instance, args, kwargs: call(), users_call, None, (), {})
    frames = [frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert len(frames) == 3 and set(frames) == {__file__}  # the test, its wrapper, the user's call
