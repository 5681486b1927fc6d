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
import socket
import stat
import types

import pytest
import torch

import autogaudi
from autogaudi.core.errors import OptionsError
from autogaudi.core.options import Options
from autogaudi.reporting import output_file as report_file
from autogaudi.store.cache import TAG, Cache
from autogaudi.store.cache import main as cache_main
from autogaudi.store.decisions import Memory
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


def _snapshot(folder):
    """Every file and link under ``folder`` and what it holds (links not followed)."""
    return {
        str(path.relative_to(folder)): os.readlink(path) if path.is_symlink() else path.is_dir() or path.read_bytes()
        for path in sorted(folder.rglob("*"))
    }


SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55\n"
FOREIGN_TAGS = {
    "cargo": SIGNATURE + "# This file is a cache directory tag created by cargo.\n# For information about cache "
    "directory tags see https://bford.info/cachedir/\n",
    "pytest": SIGNATURE + "# This file is a cache directory tag created by pytest.\n# For information about cache "
    "directory tags, see:\n#\thttps://bford.info/cachedir/spec.html\n",
    "signature alone": SIGNATURE,
}


@pytest.mark.parametrize("tool", sorted(FOREIGN_TAGS))
def test_a_folder_another_tool_tagged_is_refused_and_clear_or_eviction_delete_none_of_its_files(tmp_path, tool):
    project = tmp_path / "proj"
    (project / "compile" / "data").mkdir(parents=True)
    (project / "compile" / "thesis.tex").write_text("the user's thesis")
    (project / "compile" / "data" / "weights.bin").write_bytes(b"w" * 3000)
    (project / TAG).write_text(FOREIGN_TAGS[tool])
    before = _snapshot(project)
    cache = Cache(str(project), max_bytes=1000)
    assert cache.refusal() is not None and TAG in cache.refusal()
    assert cache.evict() == [] and cache.clear() is False
    with pytest.raises(OSError):
        cache.claim()
    assert cache_main(["clear", "--cache-dir", str(project)]) == 2
    if tool == "cargo":  # a run is refused before the script starts, as for a folder of others' files
        env = clean_env(AUTOGAUDI_NO_CACHE="0")
        result = run_python(
            "-m", "autogaudi", "--cache-dir", project, "--cache-max-mb", "1", SCRIPTS / "exits.py", env=env
        )
        assert result.returncode == 2 and TAG in result.stderr
    assert _snapshot(project) == before


def _another_users(folder, mode=0o777):
    """``folder`` made, given to another user (nobody's uid) and left writable as ``mode`` says."""
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user needs root")
    folder.mkdir(exist_ok=True)
    os.chown(folder, 65534, 65534)
    folder.chmod(mode)
    return folder


def test_a_cache_below_a_folder_others_could_swap_it_in_is_neither_read_nor_written(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone may rename what is in it: not sticky
    cache = Cache(str(shared / "autogaudi"), 10**6)
    assert cache.distrust() is not None and str(shared) in cache.distrust()
    with pytest.raises(OSError):
        cache.claim()
    assert os.listdir(shared) == []  # not even the tag
    shared.chmod(0o1777)  # sticky, as /tmp: only an entry's owner may rename it
    assert cache.distrust() is None


def test_a_folder_above_writable_by_its_group_is_trusted_only_where_the_group_is_the_users_own(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another group needs root")
    above = tmp_path / "project"
    above.mkdir()
    above.chmod(0o770)  # umask 002's folders: the user's own private group may write
    cache = Cache(str(above / "autogaudi"), 10**6)
    assert cache.distrust() is None
    os.chown(above, -1, 65534)  # a group others are in
    assert cache.distrust() is not None and str(above) in cache.distrust()


def test_an_untrusted_folder_gets_nothing_written_not_even_the_tag(tmp_path):
    root = _another_users(tmp_path / "theirs")
    autogaudi.enable(no_cache=False, cache_dir=str(root))
    facts = autogaudi.report().as_dict()["cache"]
    autogaudi.disable()
    assert facts["dir"] is None and "cache_untrusted" in facts["note_codes"]
    assert os.listdir(root) == []


def test_a_cache_swapped_for_another_users_folder_during_a_run_is_neither_read_nor_written(tmp_path):
    root = tmp_path / "cache"
    cache = Cache(str(root), 10**6)
    backend = types.SimpleNamespace(name="cpu", device_key=lambda: "a CPU")
    memory = Memory(cache, backend, Options())
    memory.script = {"path": str(tmp_path / "train.py"), "sha256": "0" * 64}  # pytest's __main__ may be no file
    cache.write_json(os.path.join(memory.folder, "mine.json"), {"runs": 1})
    assert memory.has_entries()
    os.rename(root, tmp_path / "moved")  # another user, where they could, swaps in their own folder
    planted = _another_users(root)
    shutil.copytree(tmp_path / "moved", planted, dirs_exist_ok=True)
    before = _snapshot(planted)
    assert not memory.has_entries()  # their entries are not read,
    with pytest.raises(OSError):  # nothing is written there,
        cache.write_json(os.path.join(memory.folder, "next.json"), {"runs": 2})
    assert cache.evict() == [] and _snapshot(planted) == before
    assert "cache_untrusted" in [note.code for note in cache.notes]  # and the report says why


REPORT_REFUSED = {
    "stdout dash": lambda folder: "-",
    "fifo": lambda folder: os.mkfifo(folder / "r.json") or folder / "r.json",
    "socket": lambda folder: _socket(folder / "r.json"),
    "device": lambda folder: _device(folder / "null"),
}


def _socket(path):
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()
    return path


def _device(path):
    """A node of /dev/null's device, here (a run that replaced it would not harm the system's)."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("making a device node needs root")
    return path


@pytest.mark.parametrize("case", sorted(REPORT_REFUSED))
def test_a_report_path_that_is_not_a_regular_file_or_a_new_name_is_refused_before_the_script(tmp_path, case):
    path = REPORT_REFUSED[case](tmp_path)
    with pytest.raises(OptionsError, match="regular file"):
        report_file.check(str(path))
    if case == "fifo":  # and the launcher exits 2 before the script starts
        marker = tmp_path / "ran"
        script = tmp_path / "script.py"
        script.write_text(f"open({str(marker)!r}, 'w').close()\n")
        result = run_python("-m", "autogaudi", "--report", path, script, cwd=tmp_path)
        assert result.returncode == 2 and "regular file" in result.stderr and not marker.exists()
        assert stat.S_ISFIFO(os.lstat(path).st_mode)


@pytest.mark.parametrize("planted", ["fifo", "folder link"])
def test_what_is_planted_at_the_report_path_during_the_run_is_not_written_through(tmp_path, planted):
    folder, victim = tmp_path / "out", tmp_path / "victim"
    folder.mkdir()
    victim.mkdir()
    path = report_file.resolved(str(folder / "r.json"))
    report_file.check(path)
    if planted == "fifo":
        os.mkfifo(path)
    else:  # the folder itself swapped for a link to another
        folder.rmdir()
        folder.symlink_to(victim)
    with pytest.raises(OSError):
        report_file.write(path, "{}")
    assert os.listdir(victim) == []
    if planted == "fifo":
        assert stat.S_ISFIFO(os.lstat(path).st_mode) and os.listdir(folder) == ["r.json"]


@pytest.mark.slow
def test_a_script_compiling_its_own_model_meets_no_warning_of_autogaudis_hooks():
    """Each way a script compiles, in one plain run and two of ours: ``late`` where dynamo is imported
    only after steps ran under autogaudi, then ``torch_compile`` and ``method`` where it is imported
    before the first call (the first of them imports it: the module's own call route in the second)."""
    script = SCRIPTS / "compiled_module.py"
    plain = run_python("-W", "error::UserWarning", script, "late", "torch_compile", "method")
    assert plain.returncode == 0, plain.stderr
    for hows in (["late"], ["torch_compile", "method"]):
        ours = run_python("-W", "error::UserWarning", "-m", "autogaudi", "--quiet", script, *hows)
        expected = "".join(line for line in plain.stdout.splitlines(keepends=True) if line.split()[0] in hows)
        assert (ours.returncode, ours.stdout) == (0, expected), ours.stderr
        assert "global hooks" not in ours.stderr


UNDONE = """
import sys
import torch
import autogaudi
meta_path = list(sys.meta_path)
autogaudi.enable(no_cache=True)
autogaudi.disable()
assert sys.meta_path == meta_path, sys.meta_path  # no wait for dynamo's import left behind
from torch._dynamo.eval_frame import OptimizedModule
original = OptimizedModule.__call__
autogaudi.enable(no_cache=True)  # dynamo loaded: wrapped at once
assert OptimizedModule.__call__ is not original
autogaudi.disable()
assert OptimizedModule.__call__ is original
"""


def test_the_wait_for_dynamo_and_the_compiled_modules_wrapper_are_undone_exactly():
    result = run_python("-c", UNDONE)
    assert result.returncode == 0, result.stderr


def test_a_memory_limit_of_less_than_a_byte_is_refused_naming_the_valid_range():
    for wrong in ("1e-30", "1e-10"):
        with pytest.raises(OptionsError, match="1e-09"):
            Options(memory_limit=wrong)
    assert Options(memory_limit="1e-09").memory_limit == 1e-09


def test_the_launcher_exits_2_on_a_memory_limit_of_no_byte(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")
    result = run_python("-m", "autogaudi", "--memory-limit", "1e-30", script)
    assert result.returncode == 2 and "ran" not in result.stdout


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"XDG_CACHE_HOME": ".", "HOME": "/home/u"}, "/home/u/.cache/autogaudi"),  # relative: ignored (XDG)
        ({"XDG_CACHE_HOME": "/x/cache", "HOME": "/home/u"}, "/x/cache/autogaudi"),
        ({"HOME": ""}, "password database"),
        ({"HOME": "relative"}, "password database"),
    ],
)
def test_the_default_cache_folder_ignores_relative_or_empty_settings(monkeypatch, environ, expected):
    import pwd

    from autogaudi.store.cache import default_root

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    home = pwd.getpwuid(os.getuid()).pw_dir
    assert default_root() == expected.replace("password database", os.path.join(home, ".cache", "autogaudi"))


def test_without_a_home_folder_a_run_goes_on_without_a_cache_and_says_why(monkeypatch, tmp_path):
    import pwd

    from autogaudi.store.cache import refusal

    def unknown(uid):
        raise KeyError(uid)

    monkeypatch.setenv("HOME", "")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", unknown)
    monkeypatch.chdir(tmp_path)
    options = Options(no_cache=False)
    assert refusal(options) is None  # the launcher does not stop the run for it
    autogaudi.enable(no_cache=False)
    facts = autogaudi.report().as_dict()["cache"]
    autogaudi.disable()
    assert facts["dir"] is None and facts["note_codes"] == ["cache_not_used"]
    assert os.listdir(tmp_path) == []


DOCTOR_SCRIPTS = SCRIPTS.parent / "diagnosis" / "scripts"


def test_the_doctors_projection_prints_nothing_and_names_no_absurd_batch(capsys):
    diagnosis = autogaudi.doctor(str(DOCTOR_SCRIPTS / "printing_forward.py"), steps=2)
    assert capsys.readouterr().out.count("forward called") == 2  # the two steps' forwards, as plain prints them
    rows = diagnosis.figures["memory"]["devices"].values()
    batches = [row[key] for row in rows for key in ("largest_batch", "largest_batch_checkpointed")]
    assert batches and all(batch is not None and 8 < batch <= 10**6 for batch in batches)  # not billions
    assert "None" not in diagnosis.format()


def test_the_doctor_says_a_script_that_exited_before_a_step_left_nothing_to_judge():
    diagnosis = autogaudi.doctor(str(DOCTOR_SCRIPTS / "needs_arguments.py"))
    assert (diagnosis.outcome, diagnosis.as_dict()["exit_status"], diagnosis.findings) == ("exited", 2, [])
    assert "no findings" not in diagnosis.format()
