"""The --report file: refused before the run where it cannot be written, never written through a
link, never left half-written, and the short report on stderr whatever became of the file."""

import json
import os

import pytest

from autogaudi.core.errors import OptionsError
from autogaudi.reporting import output_file as report_file
from tests.helpers import SCRIPTS, full_filesystem, plain_run, run_python

REFUSED = {
    "missing folder": lambda tmp: tmp / "missing" / "r.json",
    "a folder": lambda tmp: tmp,
    "planted link": lambda tmp: _link(tmp / "r.json", tmp / "victim.txt"),
    "unwritable folder": lambda tmp: _unwritable(tmp / "locked") / "r.json",
}


def _link(path, target):
    target.write_text("the user's own file\n")
    path.symlink_to(target)
    return path


def _unwritable(folder):
    folder.mkdir()
    folder.chmod(0o500)
    if os.access(folder, os.W_OK):
        pytest.skip("this user writes into read-only folders (root without the check)")
    return folder


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_path_the_report_cannot_be_written_to_is_refused_naming_it(tmp_path, case):
    if case == "unwritable folder" and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    path = REFUSED[case](tmp_path)
    with pytest.raises(OptionsError, match="report="):
        report_file.check(str(path))


def test_a_link_planted_after_the_check_is_not_followed(tmp_path):
    path = tmp_path / "r.json"
    report_file.check(str(path))
    victim = tmp_path / "victim.txt"
    _link(path, victim)
    with pytest.raises(OSError):
        report_file.write(str(path), "{}")
    assert victim.read_text() == "the user's own file\n"
    assert set(os.listdir(tmp_path)) == {"r.json", "victim.txt"}  # no temporary left beside them


def test_the_file_is_replaced_whole_and_readable_as_open_would_make_it(tmp_path):
    path = tmp_path / "r.json"
    path.write_text("old")
    report_file.write(str(path), '{"new": 1}')
    assert json.loads(path.read_text()) == {"new": 1}
    assert set(os.listdir(tmp_path)) == {"r.json"}
    mask = os.umask(0)
    os.umask(mask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    with full_filesystem(tmp_path / "full") as full:
        path = full / "r.json"
        with pytest.raises(OSError):
            report_file.write(str(path), "x" * 100_000)
        assert sorted(os.listdir(full)) == ["filler"]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing folder", "planted link"])
def test_the_launcher_stops_before_the_script_runs(tmp_path, case):
    path = REFUSED[case](tmp_path)
    marker = tmp_path / "script_ran"
    script = tmp_path / "script.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    result = run_python("-m", "autogaudi", "--report", path, script)
    assert result.returncode == 2
    assert str(path) in result.stderr
    assert not marker.exists()
    if case == "planted link":
        assert (tmp_path / "victim.txt").read_text() == "the user's own file\n"


@pytest.mark.slow
def test_a_full_disk_still_gives_the_short_report_and_the_scripts_exit_code(tmp_path):
    with full_filesystem(tmp_path / "full") as full:
        path = full / "r.json"
        result = run_python("-m", "autogaudi", "--quiet", "--report", path, SCRIPTS / "train_tiny.py")
        plain = plain_run(SCRIPTS / "train_tiny.py")
        assert (result.returncode, result.stdout) == (plain.returncode, plain.stdout)
        assert "report (torch" in result.stderr  # the short report, though --quiet: the file is lost
        assert f"the report file {path} was not written" in result.stderr
        assert sorted(os.listdir(full)) == ["filler"]  # no truncated JSON, no temporary left


@pytest.mark.slow
def test_a_relative_path_is_written_where_the_run_started_though_the_script_changes_folder(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = tmp_path / "script.py"
    script.write_text(f"import os, torch\nos.chdir({str(elsewhere)!r})\n")
    result = run_python("-m", "autogaudi", "--quiet", "--report", "r.json", script, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["enabled_by"] == ["launcher"]
    assert not (elsewhere / "r.json").exists()


def test_enable_refuses_a_report_path_that_cannot_be_written(tmp_path):
    import autogaudi

    with pytest.raises(OptionsError, match="report="):
        autogaudi.enable(report=str(tmp_path / "missing" / "r.json"))
    assert not autogaudi.is_enabled()
