"""The session's start order: registry order, each unit after the units it requires or names in
``after``; and a unit whose required unit is not on is skipped, saying which."""

import os

import pytest

import autogaudi
from autogaudi.core import session
from autogaudi.core.registry import UNIT_NAMES, UNITS
from tests.helpers import clean_env, run_python


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
        for needed in (*unit_class.spec.requires, *unit_class.spec.after):
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


def test_a_units_listener_added_once_profiled_runs_before_a_later_started_units():
    """fp16's loss scaling listens after each backward only once the step is profiled; fast_ddp (opt-in),
    started after it, listens from the start: the gradients are unscaled before they are averaged."""
    import torch
    from torch import nn

    from autogaudi.core.events import Event
    from autogaudi.entry import runtime
    from tests.optimizations.test_step_profiler import STEPS

    autogaudi.enable(device="cpu", only="step_profiler,mixed_precision,fast_ddp", precision="fp16", force="fast_ddp")
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(STEPS):
        nn.functional.cross_entropy(net(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
        optimizer.step()
        optimizer.zero_grad()
    live = runtime._STATE.session
    assert live.unit("mixed_precision").candidate.scope is not None  # its loss scaling is set up
    owners = [listener.owner.name for listener in live.events._listeners[Event.AFTER_BACKWARD]]
    assert "mixed_precision" in owners and "fast_ddp" in owners
    assert owners.index("mixed_precision") < owners.index("fast_ddp")


ONE_STEP = """
import torch

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(2, 4)).sum().backward()
optimizer.step()
"""


def test_a_run_that_compiled_nothing_leaves_the_cache_unwalked_at_exit(tmp_path):
    """Eviction at exit is for what compilers wrote (autogaudi's own writes evict as they write): a
    run that compiled nothing does not walk the cache, however full, and the next compile's exit does."""
    script, cache = tmp_path / "one_step.py", tmp_path / "cache"
    script.write_text(ONE_STEP)
    env = clean_env(AUTOGAUDI_NO_CACHE="0", AUTOGAUDI_CACHE_DIR=cache, AUTOGAUDI_CACHE_MAX_MB="1")
    assert run_python("-m", "autogaudi", "--quiet", script, env=env).returncode == 0  # makes the tagged folder
    big = cache / "compile" / "inductor" / "old"
    big.parent.mkdir(parents=True, exist_ok=True)
    big.write_bytes(b"0" * (2 * 1024 * 1024))
    os.utime(big, (1, 1))
    result = run_python("-m", "autogaudi", "--quiet", script, env=env)
    assert result.returncode == 0, result.stderr
    assert big.exists()
