"""hpu_mode, asked for (--trial hpu_mode): where a script runs in both of Gaudi's modes, a run measures
its mode's steady state, the next tries the other (PT_HPU_LAZY_MODE set before the bridge loads), later
runs set the faster; under the defaults the release's default mode in every run. On the HPU double with
injected step times (no wall clock)."""

import sys
import types

import pytest
import torch
from torch import nn

import autogaudi
from autogaudi.optimizations.hpu_mode import modes
from autogaudi.store.cache import Cache
from tests.conftest import _forget_hpu_double


@pytest.fixture
def script(tmp_path, monkeypatch):
    path = tmp_path / "train.py"
    path.write_text("import torch\nmodel = torch.nn.Linear(2, 2)\n")
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace(__file__=str(path)))
    monkeypatch.delenv("PT_HPU_LAZY_MODE", raising=False)
    return str(path)


@pytest.mark.parametrize(("lazy_ms", "eager_ms", "faster"), [(10.0, 7.0, "eager"), (6.0, 7.0, "lazy")])
def test_the_other_mode_is_tried_then_the_faster_is_set(tmp_path, script, monkeypatch, lazy_ms, eager_ms, faster):
    cache = Cache(str(tmp_path / "cache"), 64 * 1024 * 1024)
    source = open(script).read()
    assert modes.decide(cache, script, source, False, asked=True) == {
        "code": "first_run",
        "mode": None,
        "set": False,
        "record": {"lazy": None, "eager": None},
    }
    modes.remember(cache, script, "lazy", lazy_ms)
    assert modes.decide(cache, script, source, False, asked=True)["code"] == "trying_other"
    assert modes.VARIABLE in __import__("os").environ and __import__("os").environ[modes.VARIABLE] == "0"
    monkeypatch.delenv(modes.VARIABLE)
    modes.remember(cache, script, "eager", eager_ms)
    decided = modes.decide(cache, script, source, False, asked=True)
    assert (decided["code"], decided["mode"]) == ("remembered_faster", faster)
    assert decided["record"] == {"lazy": lazy_ms, "eager": eager_ms}


def test_a_mode_the_environment_or_the_script_sets_is_not_chosen(tmp_path, script, monkeypatch):
    cache = Cache(str(tmp_path / "cache"), 64 * 1024 * 1024)
    modes.remember(cache, script, "lazy", 5.0)
    assert modes.decide(cache, script, "model = torch.compile(model)\n", False, asked=True) == {
        "code": "script_tied",
        "mode": "eager",
    }
    assert modes.decide(cache, script, "wrap_in_hpu_graph(model)\n", False, asked=True)["mode"] == "lazy"
    assert modes.decide(cache, script, "", True, asked=True) == {"code": "bridge_loaded_first"}
    monkeypatch.setenv(modes.VARIABLE, "1")
    assert modes.decide(cache, script, "", False, asked=True) == {"code": "set_by_environment", "mode": "lazy"}


def _train(step_clock, ms):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(12):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        step_clock.advance(ms / 1000)


def _run_once(hpu_double, step_clock, cache_dir, ms, trial="hpu_mode"):
    """One run of the script: the double forgotten (a new process), autogaudi enabled before the
    bridge loads, a loop whose every step takes ``ms`` on the injected clock, the run's end."""
    from autogaudi.entry import runtime

    _forget_hpu_double()
    autogaudi.enable(device="hpu", only="hpu_mode", no_cache=False, cache_dir=cache_dir, trial=trial)
    _train(step_clock, ms)
    session = runtime._STATE.session
    unit = next(unit for unit in session.applied if unit.name == "hpu_mode")
    unit.run_ending(None)
    row = autogaudi.report().unit("hpu_mode")
    autogaudi.disable()
    return row


def test_each_run_measures_its_mode_and_the_third_sets_the_faster(hpu_double, step_clock, script, tmp_path):
    hpu_double(lazy=None)  # the double importable; each run below loads it afresh
    cache_dir = str(tmp_path / "cache")
    first = _run_once(hpu_double, step_clock, cache_dir, 10.0)
    default = "lazy" if hpu_double.release == "1.19" else "eager"
    other = "eager" if default == "lazy" else "lazy"
    assert (first["reason_code"], first["figures"]["mode"]) == ("first_run", default)
    assert first["figures"][f"{default}_ms_per_step"] == pytest.approx(10.0)
    second = _run_once(hpu_double, step_clock, cache_dir, 4.0)
    assert (second["reason_code"], second["figures"]["mode"]) == ("trying_other", other)
    assert second["figures"] == {**second["figures"], f"{default}_ms_per_step": 10.0, f"{other}_ms_per_step": 4.0}
    assert "measured" in second["note_codes"]
    third = _run_once(hpu_double, step_clock, cache_dir, 4.0)
    assert (third["reason_code"], third["figures"]["mode"]) == ("remembered_faster", other)


def test_under_the_defaults_every_run_keeps_the_releases_default_mode(hpu_double, step_clock, script, tmp_path):
    """Which mode a run gets would hang on the cache's state and on step times the load moves, and the
    modes round differently: unasked, nothing is measured or set, run after run."""
    hpu_double(lazy=None)
    cache_dir = str(tmp_path / "cache")
    default = "lazy" if hpu_double.release == "1.19" else "eager"
    for ms in (10.0, 4.0, 4.0):
        row = _run_once(hpu_double, step_clock, cache_dir, ms, trial=())
        assert (row["reason_code"], row["figures"]["mode"], row["figures"]["mode_set"]) == (
            "changes_numbers",
            default,
            0,
        )
        assert not any(name.endswith("_ms_per_step") for name in row["figures"])
