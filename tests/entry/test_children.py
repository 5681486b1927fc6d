"""Work autogaudi did in child processes reaches the parent's report: Hogwild trainers (forked or
spawned by multiprocessing, each with its own optimizer) write their part, the parent merges them,
and the user's stderr gets one report, not one per process."""

import json
import os

import pytest

from autogaudi._version import __version__
from autogaudi.entry import children
from tests.helpers import SCRIPTS, clean_env, run_python


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_hogwild_children_reach_the_parent_s_report(start_method, tmp_path):
    report_path = tmp_path / "report.json"
    folders = tmp_path / "tmp"
    folders.mkdir()
    env = clean_env(START_METHOD=start_method, TMPDIR=folders)
    plain = run_python(SCRIPTS / "hogwild.py", env=env)
    result = run_python("-m", "autogaudi", "--report", report_path, SCRIPTS / "hogwild.py", env=env)
    assert result.returncode == plain.returncode == 0, result.stderr
    assert result.stdout == plain.stdout
    assert result.stderr.count(f"autogaudi {__version__} report") == 1, result.stderr  # the parent's only
    report = json.loads(report_path.read_text())
    parts = report["children"]
    assert [part["started_by"] for part in parts] == [start_method, start_method]
    assert [part["steps"]["steps"] for part in parts] == [30, 30]
    assert [part["steps"]["evaluation_forward_passes"] for part in parts] == [4, 4]
    assert all(part["statuses"]["fused_optimizer"] == "applied" for part in parts)
    assert all("fused_optimizer" in {change["unit"] for change in part["changed"]} for part in parts)
    assert report["steps"]["steps"] == 0  # the parent trained nothing itself
    assert not any(folders.glob("autogaudi-children-*"))  # the parent took its folder away


def test_a_process_without_children_reports_none():
    import autogaudi

    autogaudi.enable(device="cpu", only="throughput_meter")
    import torch  # noqa: F401  (the session starts with torch)

    assert autogaudi.report().as_dict()["children"] == []
    assert not children.is_child()


def test_a_forked_child_writes_its_own_counts_not_its_parent_s():
    """os.fork() after the parent trained: the child's part counts only what it did after the fork,
    and the child prints no report (its exit writes the part)."""
    import os

    import torch
    from torch import nn

    import autogaudi
    from autogaudi.entry import runtime

    autogaudi.enable(device="cpu", only="throughput_meter")
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train(steps):
        for _ in range(steps):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    train(5)
    pid = os.fork()
    if pid == 0:  # the child: its exit as multiprocessing's would end it, then no atexit
        try:
            train(3)
            runtime.report_at_exit()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    report = autogaudi.report().as_dict()
    assert [(part["pid"], part["started_by"], part["steps"]["steps"]) for part in report["children"]] == [
        (pid, "fork", 3)
    ]
    assert report["steps"]["steps"] == 5


def test_folders_of_runs_that_were_killed_go_with_a_later_runs_own(tmp_path):
    """SIGKILL leaves a run no chance to remove its folder: a later run that removes its own (a child
    wrote there) removes those whose owner is gone, and nothing else (a live run's folder, a name not
    quite autogaudi's)."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = int(dead.stdout)
    names = {
        "stale": f"{children.PREFIX}{gone}-abcd1234",
        "alive": f"{children.PREFIX}{os.getpid()}-abcd1234",
        "other": f"{children.PREFIX}{gone}-abcd12345",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
    children._remove_stale_folders(str(tmp_path))
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([names["alive"], names["other"]])


NO_CHILD = r"""
import json, os, sys, tempfile
import torch
import autogaudi

autogaudi.enable(device="cpu", quiet=True, only="throughput_meter")
named = os.environ["AUTOGAUDI_CHILD_REPORTS"]
seen = {"named_in_temp": os.path.dirname(named) == tempfile.gettempdir(), "made": os.path.exists(named)}
autogaudi.disable()
seen["env_left"] = "AUTOGAUDI_CHILD_REPORTS" in os.environ
print(json.dumps(seen))
"""


def test_a_run_that_starts_no_child_makes_no_folder(tmp_path):
    """The folder is named at start and made by the first child with a part: a run without children
    neither makes one nor lists the temporary folder, and leaves the environment as it found it."""
    result = run_python("-c", NO_CHILD, env=clean_env(TMPDIR=tmp_path))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {"named_in_temp": True, "made": False, "env_left": False}
    assert list(tmp_path.iterdir()) == []


def test_a_child_makes_the_folder_private_and_refuses_one_it_does_not_own(tmp_path):
    folder = tmp_path / "parts"
    children._make_folder(str(folder))
    assert folder.is_dir() and folder.stat().st_mode & 0o777 == 0o700
    children._make_folder(str(folder))  # a second child finds it made
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        children._make_folder(str(tmp_path / "link"))


def test_a_run_whose_child_wrote_removes_its_folder_and_killed_runs_ones(tmp_path, monkeypatch):
    import subprocess
    import sys

    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)
    parts = children._Parts()
    parts.folder, parts.owner = str(tmp_path / f"{children.PREFIX}{os.getpid()}-0a1b2c3d"), True
    monkeypatch.setattr(children, "_PARTS", parts)
    children._make_folder(parts.folder)  # as its first child with a part would
    (tmp_path / f"{children.PREFIX}{gone}-abcd1234").mkdir()
    children.stop()
    assert list(tmp_path.iterdir()) == []
