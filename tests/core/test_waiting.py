"""Units loaded at the first event they act on (autogaudi/core/waiting.py): not imported before it,
started at it and hearing it, and loaded at the start where their row must say at once where they
stand. Each start in a fresh process, where importing a unit's module is what is observed."""

import json

import pytest

from autogaudi.core.registry import UNITS
from tests.helpers import clean_env, run_python

WAITING = [info for info in UNITS if info.waits_for]

STARTED = r"""
import json, sys
import torch
import autogaudi
from autogaudi.entry import runtime

autogaudi.enable(device="cpu", quiet=True, **json.loads(sys.argv[1]))
session = runtime._STATE.session

def seen():
    rows = {name: autogaudi.report().unit(name) for name in sys.argv[2:]}
    return {
        name: {
            "loaded": session.unit(name) is not None,
            "in_force": session.unit(name) in session.applied,
            "status": row["status"],
            "code": row["reason_code"],
        }
        for name, row in rows.items()
    }

before = seen()
loader = torch.utils.data.DataLoader(torch.arange(32.0).reshape(16, 2), batch_size=4)
built = seen()
for batch in loader:
    pass
print(json.dumps({"before": before, "built": built, "iterated": seen()}))
"""


def started(options: dict, names) -> dict:
    result = run_python("-c", STARTED, json.dumps(options), *names, env=clean_env())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_a_waiting_unit_watches_until_its_first_event_then_is_in_force_from_it():
    seen = started({}, [info.name for info in WAITING])
    for info in WAITING:
        assert seen["before"][info.name] == {
            "loaded": False,
            "in_force": False,
            "status": "watching",
            "code": info.waiting,
        }
    loader_units = [info.name for info in WAITING if "LOADER_BUILT" in info.waits_for]
    assert loader_units
    for name in loader_units:  # in force from the loader's construction, which it heard
        assert seen["built"][name]["in_force"] and seen["built"][name]["code"] != "no_loader"
    assert seen["iterated"]["loader_workers"]["code"] == "measuring"  # it timed the loader it was built with
    profile_units = [info.name for info in WAITING if info.waits_for == ("STEP_PROFILED",)]
    assert profile_units and not any(seen["iterated"][name]["loaded"] for name in profile_units)  # no profile


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"exact": True}, ("skipped", "not_exact")),  # whether it may act under --exact, said at the start
        ({"trial": "channels_last"}, ("watching", "waiting_for_profile")),  # asked for: in force at once
        ({"disable": "step_profiler"}, ("skipped", "needs_unit")),  # no profile will come
    ],
    ids=["exact", "asked-for", "no-profiler"],
)
def test_a_unit_whose_row_must_speak_at_the_start_loads_there(options, expected):
    seen = started(options, ["channels_last"])["before"]["channels_last"]
    assert seen["loaded"] and (seen["status"], seen["code"]) == expected
