"""Whatever way a script ends, and whatever became of the files autogaudi left, the user's files stay
as plain PyTorch would leave them, the output and exit code are plain's, and the next run is right.

Each cell runs tests/scripts/exits.py in a project folder that holds the user's own files: plain, then
under ``python -m autogaudi`` with a cache, from the same starting folder; then again under autogaudi
with the cache the run before left, ended in every way a process ends, or spoilt in every way a file
can be (cut short, garbage, valid JSON of the wrong shape, a link out, another user's), or on a full
or read-only disk."""

import hashlib
import json
import os
import shutil

import pytest
import torch

from tests.helpers import CORRUPTIONS, OTHER_USER, SCRIPTS, clean_env, corrupt, run_python, small_filesystem

EXITS = ("normal", "exception", "sys_exit", "os_exit", "sigint", "sigterm", "sigkill")
USERS_FILES = {"dataset.bin": os.urandom(4096), "notes.txt": b"the user's notes\n"}


def _project(folder):
    """A fresh project folder: the script and the user's files, nothing else."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir()
    shutil.copy(SCRIPTS / "exits.py", folder / "train.py")
    for name, data in USERS_FILES.items():
        (folder / name).write_bytes(data)
    return folder


def _contents(folder):
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in folder.iterdir() if path.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize("how", EXITS)
def test_every_exit_path_keeps_the_users_files_output_and_exit_code_and_the_next_run_is_right(tmp_path, how):
    project, cache, temporary = tmp_path / "project", tmp_path / "cache", tmp_path / "tmp"
    temporary.mkdir()
    env = clean_env(EXIT=how, TMPDIR=temporary)
    plain = run_python("train.py", env=env, cwd=_project(project))
    plain_files = _contents(project)
    plain_checkpoint = torch.load(project / "checkpoint.pt")

    ours_env = clean_env(EXIT=how, TMPDIR=temporary, AUTOGAUDI_NO_CACHE="0", AUTOGAUDI_CACHE_DIR=cache)
    ours = run_python("-m", "autogaudi", "train.py", env=ours_env, cwd=_project(project))
    assert (ours.returncode, ours.stdout) == (plain.returncode, plain.stdout)
    assert ours.stderr.startswith(plain.stderr)  # plain's traceback, unchanged; the report may follow
    files = _contents(project)
    assert {name: files[name] for name in USERS_FILES} == {name: plain_files[name] for name in USERS_FILES}
    assert sorted(files) == sorted(plain_files)
    checkpoint = torch.load(project / "checkpoint.pt")  # loadable by plain PyTorch, the same numbers
    assert checkpoint.keys() == plain_checkpoint.keys()
    for name, tensor in checkpoint.items():
        torch.testing.assert_close(tensor, plain_checkpoint[name], rtol=1e-5, atol=1e-6)

    again = run_python("-m", "autogaudi", "train.py", env={**ours_env, "EXIT": "normal"}, cwd=project)
    assert again.returncode == 0, again.stderr
    assert again.stdout == plain.stdout  # the loss line, printed before the script leaves, whichever way
    assert "report (torch" in again.stderr
    assert {name: (project / name).read_bytes() for name in USERS_FILES} == USERS_FILES
    leftovers = [name for name in os.listdir(temporary) if name.startswith("autogaudi")]
    assert leftovers == []  # no folder of autogaudi's left behind, however the run before ended


# Every file a run leaves in the cache, by where it lies under the cache's root.
CACHE_FILES = {"decisions entry": "decisions/*/*.json", "cache tag": "CACHEDIR.TAG", "lock": ".lock"}
# Only the entry is parsed: the tag is compared with its signature and the lock never read, so cut
# short, garbage and the wrong JSON meet one branch there, and garbage stands for the three.
PARSED = ("decisions entry",)
SPOILT = [
    (name, how)
    for name in CACHE_FILES
    for how in (*CORRUPTIONS, OTHER_USER)
    if name in PARSED or how not in ("truncated", "wrong_schema")
]
FILESYSTEMS = ("full", "read_only")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A cache as a finished run left it (its decisions remembered), and plain's output of the script."""
    folder = tmp_path_factory.mktemp("first")
    env = clean_env(STEPS=STEPS)
    plain = run_python("train.py", env=env, cwd=_project(folder / "project"))
    cache = folder / "cache"
    ours = run_python("-m", "autogaudi", "train.py", env=_cached(env, cache), cwd=folder / "project")
    assert ours.returncode == 0, ours.stderr
    assert list(cache.glob(CACHE_FILES["decisions entry"]))
    return folder / "project", cache, plain  # the project's path is part of the decisions' key


STEPS = "60"  # enough steps for the step profile, and so the decisions, to be written


def _cached(env, cache, **extra):
    return {**env, "AUTOGAUDI_NO_CACHE": "0", "AUTOGAUDI_CACHE_DIR": str(cache), **extra}


def _run_twice(project, cache, plain, report):
    """The run that meets the spoilt cache, then the next one: both as plain's, the user's files kept."""
    env = _cached(clean_env(STEPS=STEPS), cache)
    results = []
    for name in ("met", "next"):
        result = run_python(
            "-m", "autogaudi", "--report", report.with_suffix(f".{name}.json"), "train.py", env=env, cwd=project
        )
        assert (result.returncode, result.stdout) == (plain.returncode, plain.stdout), result.stderr
        assert "autogaudi:" not in result.stderr  # no line of autogaudi's: what it met is in the report
        assert {name: (project / name).read_bytes() for name in USERS_FILES} == USERS_FILES
        results.append(json.loads(report.with_suffix(f".{name}.json").read_text()))
    return results


@pytest.mark.slow
@pytest.mark.parametrize(("name", "how"), SPOILT)
def test_a_spoilt_cache_file_changes_nothing_a_user_sees_and_the_next_run_is_right(tmp_path, first_run, name, how):
    if how == OTHER_USER and os.geteuid() != 0:
        pytest.skip("handing a file to another user needs root")
    project, template, plain = first_run
    cache = tmp_path / "cache"
    shutil.copytree(template, cache, symlinks=True)
    path = next(cache.glob(CACHE_FILES[name]))
    outside = tmp_path / "outside"
    if name == "decisions entry":  # the entry as written, but for a field of the wrong type
        corrupt(path, how, outside, wrong=json.dumps({**json.loads(path.read_text()), "profile": "zzz"}).encode())
    else:
        corrupt(path, how, outside)
    outside_before = _contents(outside) if outside.exists() else {}

    met, after = _run_twice(_project(project), cache, plain, tmp_path / "report")
    assert (_contents(outside) if outside.exists() else {}) == outside_before  # a link's target untouched
    assert after["cache"]["dir"] == str(cache)
    assert after["cache"]["note_codes"] == []  # the next run finds a cache it can use as it is
    if name == "decisions entry" and how != OTHER_USER:
        assert set(met["cache"]["note_codes"]) <= {"entry_invalid", "entry_unreadable"}
        assert met["cache"]["note_codes"]  # dropped, with a note,
        assert _profiled_as(met) != "remembered_profile"  # measured afresh,
        assert _profiled_as(after) == "remembered_profile"  # and replaced by what that run decided


def _profiled_as(report):
    return next(unit["reason_code"] for unit in report["units"] if unit["name"] == "step_profiler")


@pytest.mark.slow
@pytest.mark.parametrize("state", FILESYSTEMS)
def test_a_cache_on_a_full_or_read_only_disk_changes_nothing_a_user_sees(tmp_path, first_run, state):
    project, template, plain = first_run
    with small_filesystem(tmp_path / "disk", holding=template, state=state) as disk:
        met, after = _run_twice(_project(project), disk / template.name, plain, tmp_path / "report")
        for report in (met, after):  # the decisions were recalled; what could not be written is said
            assert "decisions_not_written" in report["cache"]["note_codes"]
