"""The cache folder: bounded, safe to share between processes, listed and cleared by its command,
absent with --no-cache; compile caches kept in it (inductor's; the Gaudi bridge's recipes). A second
run that compiles from the kept inductor cache: tests/store/test_decisions.py, with the remembered capture."""

import importlib
import json
import os
import pwd
import re
import time

import pytest
import wrapt

import autogaudi
from autogaudi.store.cache import LAYOUT, NOTES, TAG, Cache
from autogaudi.store.cache import main as cache_main
from tests.conftest import _forget_hpu_double
from tests.helpers import HPU_DOUBLE, REPO, SCRIPTS, clean_env, run_python

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


def test_eviction_leaves_another_processs_write_in_progress_and_clears_a_killed_ones(tmp_path):
    """A write's temporary, made before newer files (its process was descheduled on a busy machine),
    is not pulled from under it; one an hour old is a leftover, evicted like any file."""
    cache = Cache(str(tmp_path), max_bytes=1500)
    cache.claim()
    folder = tmp_path / "decisions"
    folder.mkdir(exist_ok=True)
    for name, age in ((".writing-live", 50), (".writing-dead", 2 * 3600), ("older.json", 40), ("newer.json", 0)):
        path = folder / name
        path.write_text("x" * 1000)
        os.utime(path, (time.time() - age, time.time() - age))
    deleted = {os.path.basename(path) for path in cache.evict()}
    assert deleted == {".writing-dead", "older.json"}
    assert sorted(path.name for path in folder.iterdir()) == [".writing-live", "newer.json"]


def test_a_write_replaces_the_entry_whole_and_leaves_no_temporary_file(tmp_path):
    cache = Cache(str(tmp_path), max_bytes=10**6)
    path = str(tmp_path / "decisions" / "setup" / "entry.json")
    cache.write_json(path, {"runs": 1})
    cache.write_json(path, {"runs": 2})
    assert json.loads(open(path).read()) == {"runs": 2}
    assert os.listdir(os.path.dirname(path)) == ["entry.json"]


WRITER = """
import sys
from autogaudi.store.cache import Cache
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


@pytest.mark.slow
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
    # the session's backend probe imported the bridge: that import started no second session
    assert not isinstance(vars(torch.autograd)["backward"].__wrapped__, wrapt.FunctionWrapper)
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


def project(tmp_path):
    """A user's project folder: what --cache-dir . would name."""
    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "dataset.bin").write_bytes(b"d" * 2_000_000)
    (folder / "notes.txt").write_text("mine")
    (folder / "data" / "part.bin").write_bytes(b"p" * 100)
    return folder


def snapshot(folder) -> dict:
    """Every file and link under ``folder`` and what it holds (links not followed)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        found[str(path.relative_to(folder))] = (
            os.readlink(path) if path.is_symlink() else path.is_dir() or path.read_bytes()
        )
    return found


def test_a_folder_holding_other_files_is_refused_and_eviction_or_clear_delete_none_of_them(tmp_path):
    folder = project(tmp_path)
    before = snapshot(folder)
    cache = Cache(str(folder), max_bytes=1024 * 1024)
    refused = cache.refusal()
    assert refused and str(folder) in refused and TAG in refused and "dataset.bin" in refused
    assert cache.evict() == [] and cache.clear() is False
    with pytest.raises(OSError):
        cache.claim()
    assert snapshot(folder) == before


def test_the_launcher_refuses_such_a_folder_with_exit_2_before_the_script_starts(tmp_path):
    folder = project(tmp_path)
    before = snapshot(folder)
    result = run_python(
        "-m", "autogaudi", "--cache-dir", folder, "--cache-max-mb", "1", CONV, env=clean_env(AUTOGAUDI_NO_CACHE="0")
    )
    assert result.returncode == 2 and str(folder) in result.stderr and TAG in result.stderr
    assert "loss" not in result.stdout  # the script never ran
    assert snapshot(folder) == before


def test_inside_a_run_a_refused_folder_leaves_the_run_without_a_cache_and_says_why(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    folder = project(tmp_path)
    before = snapshot(folder)
    autogaudi.enable(no_cache=False, cache_dir=str(folder), cache_max_mb=1)
    facts = autogaudi.report().as_dict()["cache"]
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    autogaudi.disable()
    assert facts["dir"] is None and "cache_refused" in facts["note_codes"]
    assert snapshot(folder) == before


def test_a_new_folder_is_made_private_and_tagged_and_an_untagged_earlier_cache_is_adopted(tmp_path):
    cache = Cache(str(tmp_path / "new"), max_bytes=10**6)
    path = cache.folder("decisions", "setup")
    for level in (cache.root, os.path.dirname(path), path):
        assert os.stat(level).st_mode & 0o777 == 0o700
    tag = (tmp_path / "new" / TAG).read_text().splitlines()
    assert tag[0] == "Signature: 8a477f597d28d172789f06886806bc55" and "autogaudi" in tag[1]
    earlier = tmp_path / "earlier"  # what autogaudi wrote before it tagged its caches
    (earlier / "decisions" / "s").mkdir(parents=True)
    (earlier / ".lock").write_text("")
    assert Cache(str(earlier), 10**6).refusal() is None


def test_eviction_and_clear_touch_only_the_layout_of_a_tagged_root(tmp_path):
    cache = Cache(str(tmp_path / "cache"), max_bytes=0)
    cache.claim()
    root = tmp_path / "cache"
    (root / "mine.txt").write_text("dropped here by the user")
    for name in ("decisions/s/e.json", "compile/inductor/fx/g.py", "one_offs/m.json"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x" * 100)
    assert len(cache.evict()) == 3
    assert sorted(p.name for p in root.iterdir() if p.is_file()) == [".lock", TAG, "mine.txt"]
    (root / "one_offs" / "m.json").write_text("x")
    assert cache.clear() is True
    assert sorted(p.name for p in root.iterdir()) == [".lock", TAG, "mine.txt"]


WRITTEN = ("decisions/s/entry.json", "one_offs/machine.json", "compile/artifacts/a.json", "compile/artifacts/a.bin")


@pytest.mark.parametrize("action", ["evict", "clear"])
@pytest.mark.parametrize("linked", [*WRITTEN, "compile/inductor", *LAYOUT])
def test_links_in_the_cache_pointing_outside_are_never_followed(tmp_path, linked, action):
    cache = Cache(str(tmp_path / "cache"), max_bytes=0)
    cache.claim()
    outside = tmp_path / "outside"
    (outside / "folder").mkdir(parents=True)
    (outside / "precious.bin").write_bytes(b"p" * 1000)
    (outside / "folder" / "inner.bin").write_bytes(b"i" * 1000)
    link = tmp_path / "cache" / linked
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(outside / ("precious.bin" if "." in link.name else "folder"))
    before = snapshot(outside)
    getattr(cache, action)()
    assert snapshot(outside) == before


def test_cache_clear_and_list_on_a_folder_without_the_tag_delete_nothing_and_exit_2(tmp_path, capsys):
    folder = project(tmp_path)
    before = snapshot(folder)
    assert cache_main(["clear", "--cache-dir", str(folder)]) == 2
    assert cache_main(["list", "--cache-dir", str(folder)]) == 2
    assert snapshot(folder) == before
    earlier = tmp_path / "earlier"  # only autogaudi's names, but no tag: nothing proves they are its files
    (earlier / "decisions" / "s").mkdir(parents=True)
    (earlier / "decisions" / "s" / "e.json").write_text("{}")
    assert cache_main(["clear", "--cache-dir", str(earlier)]) == 2
    assert (earlier / "decisions" / "s" / "e.json").exists()
    assert str(folder) in capsys.readouterr().err


def make_shared(path, how):
    """Give ``path`` to another user, or let its group or others write it."""
    if how == "other_owner":
        if os.geteuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
    else:
        os.chmod(path, {"writable_by_others": 0o777, "writable_by_group": 0o770}[how])


SHARED = ("writable_by_others", "writable_by_group", "other_owner")


@pytest.mark.parametrize("level", ["", "decisions", "compile/artifacts"])
@pytest.mark.parametrize("how", SHARED)
def test_a_cache_another_user_could_write_is_not_used_unless_trusted_explicitly(tmp_path, monkeypatch, how, level):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    root = tmp_path / "cache"
    Cache(str(root), 10**6).folder(*filter(None, level.split("/")))
    make_shared(root / level, how)
    autogaudi.enable(no_cache=False, cache_dir=str(root))
    facts = autogaudi.report().as_dict()["cache"]
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # inductor is not pointed into it either
    autogaudi.disable()
    assert facts["dir"] is None and "cache_untrusted" in facts["note_codes"]
    autogaudi.enable(no_cache=False, cache_dir=str(root), cache_trust_shared=True)
    facts = autogaudi.report().as_dict()["cache"]
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root / "compile" / "inductor")
    autogaudi.disable()
    assert facts["dir"] == str(root) and "cache_untrusted" not in facts["note_codes"]


@pytest.mark.parametrize("how", SHARED)
def test_a_torch_compile_cache_another_user_could_write_is_named_in_the_notes(tmp_path, monkeypatch, how):
    inductor = tmp_path / "inductor"
    inductor.mkdir()
    make_shared(inductor, how)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    autogaudi.enable(no_cache=False, cache_dir=str(tmp_path / "cache"))
    facts = autogaudi.report().as_dict()["cache"]
    autogaudi.disable()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(inductor)  # the user's setting stays
    (code,) = [code for code in facts["note_codes"] if code == "compile_cache_untrusted"]
    assert facts["note_params"][facts["note_codes"].index(code)]["path"] == str(inductor)


def test_every_cache_note_code_is_documented():
    page = (REPO / "docs" / "cache.md").read_text()
    assert [code for code in NOTES if f"`{code}`" not in page] == []
