"""The cache folder: bounded, safe to share between processes, listed and cleared by its command,
absent with --no-cache; compile caches kept in it (inductor's; the Gaudi bridge's recipes)."""

import importlib
import json
import os
import re
import time

import pytest

import autogaudi
from autogaudi.cache import Cache
from tests.conftest import _forget_hpu_double
from tests.helpers import HPU_DOUBLE, SCRIPTS, clean_env, run_python

CONV = SCRIPTS / "train_conv.py"


def test_eviction_deletes_the_files_modified_longest_ago_until_under_the_limit(tmp_path):
    cache = Cache(str(tmp_path), max_bytes=2500)
    cache.claim()
    for age, name in enumerate(["newest", "middle", "oldest"]):
        path = tmp_path / "decisions" / f"{name}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text("x" * 1000)
        os.utime(path, (time.time() - 100 * age, time.time() - 100 * age))
    deleted = cache.evict()
    assert [os.path.basename(path) for path in deleted] == ["oldest.json"]
    assert sorted(path.name for path in (tmp_path / "decisions").iterdir()) == ["middle.json", "newest.json"]


def test_a_write_replaces_the_entry_whole_and_leaves_no_temporary_file(tmp_path):
    cache = Cache(str(tmp_path), max_bytes=10**6)
    path = str(tmp_path / "decisions" / "setup" / "entry.json")
    cache.write_json(path, {"runs": 1})
    cache.write_json(path, {"runs": 2})
    assert json.loads(open(path).read()) == {"runs": 2}
    assert os.listdir(os.path.dirname(path)) == ["entry.json"]


WRITER = """
import sys
from autogaudi.cache import Cache
cache = Cache(sys.argv[1], max_bytes=40_000)
for index in range(150):
    cache.write_json(f"{sys.argv[1]}/decisions/s/{index % 30}.json", {"writer": sys.argv[2], "payload": "x" * 900})
"""


def test_two_processes_writing_and_evicting_at_once_leave_a_consistent_cache(tmp_path):
    import subprocess
    import sys

    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), name], env=clean_env(), stderr=subprocess.PIPE)
        for name in ("a", "b")
    ]
    for writer in writers:
        _, error = writer.communicate(timeout=120)
        assert writer.returncode == 0, error.decode()
    cache = Cache(str(tmp_path), max_bytes=40_000)
    entries = cache.decisions()
    assert entries and all(entry is not None and entry["writer"] in ("a", "b") for _path, entry in entries)
    assert not [name for name in os.listdir(tmp_path / "decisions" / "s") if name.startswith(".writing-")]
    assert cache.size() <= 40_000


def run_conv(tmp_path, *options, env=None, name="run"):
    report = tmp_path / f"{name}.json"
    result = run_python(
        "-m", "autogaudi", "--report", report, *options, CONV, env=env or clean_env(AUTOGAUDI_NO_CACHE="0")
    )
    assert result.returncode == 0, result.stderr
    return json.loads(report.read_text())


def test_the_cache_command_lists_what_runs_remembered_and_clears_it(tmp_path):
    cache_dir = tmp_path / "cache"
    run_conv(tmp_path, "--cache-dir", cache_dir, "--trial", "channels_last")
    listed = run_python("-m", "autogaudi", "cache", "list", "--cache-dir", cache_dir)
    assert listed.returncode == 0, listed.stderr
    assert "remembered decisions: 1" in listed.stdout
    assert str(CONV) in listed.stdout and "Sequential" in listed.stdout
    assert re.search(r"-bound \(run 1\); channels_last (kept|rejected) \(run 1\)", listed.stdout)
    cleared = run_python("-m", "autogaudi", "cache", "clear", "--cache-dir", cache_dir)
    assert cleared.returncode == 0 and "cleared" in cleared.stdout
    assert sorted(os.listdir(cache_dir)) == [".lock", "CACHEDIR.TAG"]
    assert "remembered decisions: 0" in run_python("-m", "autogaudi", "cache", "list", "--cache-dir", cache_dir).stdout
    bad = run_python("-m", "autogaudi", "cache", "forget", "--cache-dir", cache_dir)
    assert bad.returncode == 2 and "list" in bad.stderr and "clear" in bad.stderr


@pytest.mark.parametrize("no_cache", ["1", "0"])
def test_no_cache_writes_nothing(tmp_path, no_cache):
    home = tmp_path / "home"
    home.mkdir()
    env = clean_env(AUTOGAUDI_NO_CACHE=no_cache, HOME=home)
    env.pop("XDG_CACHE_HOME", None)
    report = run_conv(tmp_path, "--trial", "channels_last", env=env)
    if no_cache == "1":
        assert list(home.iterdir()) == [] and report["cache"] is None
    else:  # the default folder, for contrast
        assert (home / ".cache" / "autogaudi" / "decisions").is_dir()
        assert report["cache"]["dir"] == str(home / ".cache" / "autogaudi")


def test_torch_compile_caches_are_kept_in_the_cache_and_a_second_run_compiles_from_them(tmp_path):
    options = ("--cache-dir", tmp_path / "cache", "--force", "graph_capture")
    first = run_conv(tmp_path, *options, name="first")
    second = run_conv(tmp_path, *options, name="second")
    capture = [next(row for row in report["units"] if row["name"] == "graph_capture") for report in (first, second)]
    assert [row["figures"]["compile_cache"] for row in capture] == ["miss", "hit"]
    assert "compiled from the cache" in capture[1]["changes"][0]
    assert any((tmp_path / "cache" / "compile" / "inductor").iterdir())
    assert first["cache"]["compile"]["TORCHINDUCTOR_CACHE_DIR"] == {
        "value": str(tmp_path / "cache" / "compile" / "inductor"),
        "set_by": "autogaudi",
    }


def test_compile_cache_variables_are_set_for_the_run_only_and_never_over_the_users(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    autogaudi.enable(no_cache=False, cache_dir=str(tmp_path))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile" / "inductor")
    autogaudi.disable()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    autogaudi.enable(no_cache=False, cache_dir=str(tmp_path))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    facts = autogaudi.report().as_dict()["cache"]["compile"]["TORCHINDUCTOR_CACHE_DIR"]
    assert facts == {"value": str(tmp_path / "mine"), "set_by": "environment"}
    autogaudi.disable()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.fixture
def bridge_not_loaded(monkeypatch):
    """The HPU double importable but not imported: autogaudi's probe is what loads it."""
    monkeypatch.syspath_prepend(str(HPU_DOUBLE))
    monkeypatch.setenv("PT_HPU_LAZY_MODE", "1")
    monkeypatch.delenv("PT_HPU_RECIPE_CACHE_CONFIG", raising=False)
    _forget_hpu_double()
    yield
    autogaudi.disable()
    _forget_hpu_double()


def test_the_hpu_recipe_cache_is_set_before_the_bridge_loads_and_recipes_are_found_again(tmp_path, bridge_not_loaded):
    import torch

    autogaudi.enable(device="hpu", no_cache=False, cache_dir=str(tmp_path), cache_max_mb=64)
    recipes = tmp_path / "compile" / "hpu_recipes"
    metrics = importlib.import_module("habana_frameworks.torch.hpu.metrics")
    assert metrics.RECIPE_CACHE == f"{recipes},false,64"  # what the bridge read when it loaded
    graphs = importlib.import_module("habana_frameworks.torch.hpu.graphs")
    inputs = torch.randn(3, 4)
    for _ in range(2):  # compiled twice, as by two processes: the second finds its recipe on disk
        graphs.wrap_in_hpu_graph(torch.nn.Linear(4, 2))(inputs)
    stats = dict(metrics.metric_global("recipe_cache").stats())
    assert stats == {"TotalHit": 1, "TotalMiss": 1} and len(list(recipes.iterdir())) == 1
    autogaudi.disable()
    assert "PT_HPU_RECIPE_CACHE_CONFIG" not in os.environ


def test_a_bridge_loaded_before_autogaudi_keeps_its_recipe_setting_and_the_report_says_so(tmp_path, hpu_double):
    hpu_double(lazy=True)
    os.environ.pop("PT_HPU_RECIPE_CACHE_CONFIG", None)
    autogaudi.enable(device="hpu", no_cache=False, cache_dir=str(tmp_path))
    assert "PT_HPU_RECIPE_CACHE_CONFIG" not in os.environ
    notes = autogaudi.report().as_dict()["cache"]["notes"]
    assert any("PT_HPU_RECIPE_CACHE_CONFIG" in note and "loaded before" in note for note in notes)
