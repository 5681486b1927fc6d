"""The contract every unit keeps, generated from the registry and each unit's machine-readable
``targets`` (dotted owner.attribute paths), in the spirit of dd-trace's PatchTestCase: on the HPU
double, where every unit applies, each target is patched exactly once while the unit is on (also
after enable() again, and after a reconfiguring enable()), and after disable() the owner holds the
very object it held before. Orders of importing torch and enabling: tests/entry/test_runtime.py."""

import importlib

import pytest
import torch
import wrapt

import autogaudi
from autogaudi.core import session
from autogaudi.core.registry import UNITS
from autogaudi.watch import steps
from tests.helpers import SWITCHED_ON_BY

MISSING = object()


def resolve(path: str):
    """(owner, attribute) for a dotted path: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1]
    raise AssertionError(f"cannot resolve {path}")


def held(path: str):
    """What the owner itself holds under the attribute (MISSING where it inherits it)."""
    owner, attribute = resolve(path)
    return vars(owner).get(attribute, MISSING)


def patch_depth(path: str) -> int:
    owner, attribute = resolve(path)
    value, depth = vars(owner).get(attribute, MISSING), 0  # the stored object, not a bound view of it
    while isinstance(value, wrapt.FunctionWrapper):
        depth, value = depth + 1, value.__wrapped__
    return depth


def unit_class(info):
    module_name, class_name = info.module.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def test_every_target_is_a_dotted_path_that_resolves():
    for info in UNITS:
        for path in unit_class(info).spec.targets:
            resolve(path)


@pytest.mark.parametrize("info", UNITS, ids=[info.name for info in UNITS])
def test_the_unit_patches_its_targets_once_and_restores_them_exactly(hpu_double, info):
    hpu_double(lazy=True)
    targets = unit_class(info).spec.targets
    paths = (*steps.TARGETS, *session.TARGETS, *targets)
    before = {path: held(path) for path in paths}
    options = {"device": "hpu", "only": ",".join(dict.fromkeys(("step_profiler", info.name)))}
    if info.opt_in:
        options["force"] = info.name
    options.update(SWITCHED_ON_BY.get(info.name, {}))
    for again in ({}, {}, {"log_every": 7}):  # enable, the same again (harmless), then reconfigure
        autogaudi.enable(**options, **again)
        if "LOADER_BUILT" in info.waits_for:  # a unit loaded at the first DataLoader: its targets from then on
            torch.utils.data.DataLoader(range(4))
        row = autogaudi.report().unit(info.name)
        # in force, nothing to act on yet (no step has run); the profile is the decision the others wait for
        assert row["status"] == ("deciding" if info.name == "step_profiler" else "watching"), row
        assert {path: patch_depth(path) for path in paths} == dict.fromkeys(paths, 1)
        assert set(targets) <= set(row["targets"])
    autogaudi.disable()
    assert all(held(path) is before[path] for path in paths), [p for p in paths if held(p) is not before[p]]
