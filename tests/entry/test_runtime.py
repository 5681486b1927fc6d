"""The process-wide guard: every ordering of import, enable and disable, each in a fresh process."""

import gc
import json

import pytest
import torch

import autogaudi
from tests.helpers import SCRIPTS, clean_env, run_python

PATCHED_ONCE = {"depth": 1, "post_hooks": 1}
UNPATCHED = {"depth": 0, "post_hooks": 0}


def scenario(name, *launcher, env=None):
    result = run_python(*launcher, SCRIPTS / "guard_matrix.py", name, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_torch_imported_first_enable_twice_disable_enable_again():
    seen = scenario("torch_first")
    assert seen["enabled_twice"] == PATCHED_ONCE
    assert seen["disabled"] == UNPATCHED
    assert seen["identity_restored"] is True
    assert seen["enabled_again"] == PATCHED_ONCE
    assert seen["identity_restored_again"] is True


def test_enable_before_torch_defers_until_torch_is_imported():
    seen = scenario("enable_first")
    assert seen["torch_loaded_by_enable"] is False
    assert "waiting for torch to be imported" in seen["report_before_torch"]
    assert seen["after_import"] == PATCHED_ONCE
    assert seen["disabled"] == UNPATCHED
    assert seen["plain_function"] == "function"


def test_enable_with_new_options_reapplies_once():
    seen = scenario("reconfigure")
    assert seen == {"after": PATCHED_ONCE, "log_every": 5}


@pytest.mark.slow
def test_launcher_env_and_enable_together_patch_once_with_cli_over_env():
    env = clean_env(AUTOGAUDI="1", AUTOGAUDI_LOG_EVERY="3")
    seen = scenario("everything_at_once", "-m", "autogaudi", "--quiet", "--log-every", "4", env=env)
    assert seen == {"after": PATCHED_ONCE, "log_every": 4}
    seen = scenario("everything_at_once", "-m", "autogaudi", "--quiet", env=env)
    assert seen == {"after": PATCHED_ONCE, "log_every": 3}


def test_keyword_options_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("AUTOGAUDI_LOG_EVERY", "3")
    monkeypatch.setenv("AUTOGAUDI_WARMUP_STEPS", "2")
    autogaudi.enable(log_every=9)
    options = autogaudi.active_options()
    assert (options.log_every, options.warmup_steps) == (9, 2)


def test_bad_keyword_raises_before_anything_is_patched():
    original = torch.autograd.backward
    with pytest.raises(autogaudi.OptionsError, match="valid choices for options: device, disable"):
        autogaudi.enable(devise="cpu")
    with pytest.raises(autogaudi.OptionsError, match="valid choices for only: gpu_migration, hpu_mode, step_marks"):
        autogaudi.enable(only=["step_marks", "warp_drive"])
    assert not autogaudi.is_enabled()
    assert torch.autograd.backward is original


def test_report_still_answers_after_disable():
    autogaudi.enable(device="cpu")
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
    autogaudi.disable()
    report = autogaudi.report().as_dict()  # still answers after disable()
    assert report["active"] is False
    assert report["steps"]["optimizer_steps"] == report["steps"]["backward_passes"] == 5
    assert report["backend"]["name"] == "cpu"


@pytest.mark.parametrize("collector_on", [True, False])
def test_starting_a_session_runs_no_garbage_collection_and_leaves_the_collector_as_it_was(collector_on):
    """Importing torch leaves a full collection due: the objects autogaudi's start allocates must
    not bring it into the user's run. At a threshold of one allocation the collector runs at every
    allocation it is on for: only the few of entering and leaving the pause may meet it (thousands
    without the pause)."""
    collections, starting = [], [False]

    def seen(phase, info):
        if phase == "start" and starting[0]:
            collections.append(info["generation"])

    threshold = gc.get_threshold()
    was_enabled = gc.isenabled()
    gc.callbacks.append(seen)
    gc.set_threshold(1)
    (gc.enable if collector_on else gc.disable)()
    try:
        starting[0] = True
        autogaudi.enable(device="cpu")
        starting[0] = False
        enabled_after = gc.isenabled()
    finally:
        gc.callbacks.remove(seen)
        gc.set_threshold(*threshold)
        (gc.enable if was_enabled else gc.disable)()
    assert autogaudi.report().as_dict()["active"] is True  # the session did start
    assert len(collections) < 10
    assert enabled_after is collector_on


WATCHES_AFTER_START = r"""
import json, sys
import autogaudi
from autogaudi.entry import import_watch
autogaudi.enable(quiet=True)
import torch
print(json.dumps(sorted(f.name for f in sys.meta_path if isinstance(f, import_watch._ImportWatcher))))
"""


def test_without_the_gaudi_bridge_installed_no_wait_for_it_outlives_the_start():
    """Every import after the start asks autogaudi's finders first: a wait for a bridge that cannot
    be imported would cost each of them a call, for nothing (torch.optim's constructor alone imports
    some 800 modules)."""
    result = run_python("-c", WATCHES_AFTER_START, env=clean_env())
    assert result.returncode == 0, result.stderr
    assert "habana_frameworks.torch" not in json.loads(result.stdout.splitlines()[-1])
