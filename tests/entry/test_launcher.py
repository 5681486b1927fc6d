"""python -m autogaudi runs a script or module exactly as python would (each run in a subprocess)."""

import json
import os

import pytest

from autogaudi import __version__
from autogaudi.entry.launcher import VALUE_FLAGS, split_command_line
from tests.helpers import SCRIPTS, TESTS, clean_env, run_python


def observed(result):
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[0])


def test_script_sees_what_a_plain_run_sees():
    plain = observed(run_python("scripts/show_main.py", "--lr", "3", "-m", "x", cwd=TESTS))
    launched = observed(run_python("-m", "autogaudi", "scripts/show_main.py", "--lr", "3", "-m", "x", cwd=TESTS))
    for key in ("argv", "path0", "name", "file", "spec", "package", "main_is_module", "torch_loaded"):
        assert launched[key] == plain[key], key
    assert launched["argv"] == ["scripts/show_main.py", "--lr", "3", "-m", "x"]
    assert launched["path0"] == str(SCRIPTS)
    assert launched["name"] == "__main__"
    assert launched["torch_loaded"] is False  # the launcher itself never imports torch
    assert launched["autogaudi_env"] == "1"  # ... and children inherit the switch


def test_symlinked_script_puts_its_real_folder_on_sys_path(tmp_path):
    link = tmp_path / "link.py"
    link.symlink_to(SCRIPTS / "show_main.py")
    plain = observed(run_python(link, cwd=tmp_path))
    launched = observed(run_python("-m", "autogaudi", link, cwd=tmp_path))
    assert launched["path0"] == plain["path0"] == str(SCRIPTS)
    assert launched["file"] == plain["file"]


@pytest.mark.parametrize("code", ["0", "3", "42"])
def test_exit_code_passes_through(code):
    env = clean_env(SHOW_MAIN_EXIT=code)
    plain = run_python(SCRIPTS / "show_main.py", env=env)
    launched = run_python("-m", "autogaudi", "--quiet", SCRIPTS / "show_main.py", env=env)
    assert launched.returncode == plain.returncode == int(code)


def test_uncaught_exception_shows_the_users_traceback_and_exits_1():
    plain = run_python(SCRIPTS / "raises.py")
    launched = run_python("-m", "autogaudi", "--quiet", SCRIPTS / "raises.py")
    assert launched.returncode == plain.returncode == 1
    assert launched.stderr == plain.stderr
    assert "autogaudi" not in launched.stderr


def test_module_mode_matches_python_dash_m():
    plain = observed(run_python("-m", "pkg.mod", "a", cwd=SCRIPTS))
    launched = observed(run_python("-m", "autogaudi", "-m", "pkg.mod", "a", cwd=SCRIPTS))
    assert launched == plain
    assert launched["argv"] == [str(SCRIPTS / "pkg" / "mod.py"), "a"]
    assert (launched["name"], launched["spec"], launched["package"]) == ("__main__", "pkg.mod", "pkg")


def test_module_mode_runs_a_packages_main():
    plain = observed(run_python("-m", "pkg", cwd=SCRIPTS))
    launched = observed(run_python("-m", "autogaudi", "-m", "pkg", cwd=SCRIPTS))
    assert launched == plain and launched["spec"] == "pkg.__main__"


def test_module_mode_exception_exits_1_with_the_users_frames():
    launched = run_python("-m", "autogaudi", "--quiet", "-m", "pkg.mod", "fail", cwd=SCRIPTS)
    assert launched.returncode == 1
    assert "KeyError: 'module failure'" in launched.stderr
    source = (SCRIPTS / "pkg" / "mod.py").read_text().splitlines()
    line = next(number for number, text in enumerate(source, 1) if "raise KeyError" in text)
    assert f'pkg/mod.py", line {line}, in <module>' in launched.stderr
    assert "autogaudi" not in launched.stderr


def test_missing_script_and_module_fail_like_python(tmp_path):
    plain = run_python("nope.py", cwd=tmp_path)
    launched = run_python("-m", "autogaudi", "nope.py", cwd=tmp_path)
    assert launched.returncode == plain.returncode == 2
    assert launched.stderr.split(": ", 1)[1] == plain.stderr.split(": ", 1)[1]
    plain = run_python("-m", "no_such_module_xyz", cwd=tmp_path)
    launched = run_python("-m", "autogaudi", "-m", "no_such_module_xyz", cwd=tmp_path)
    assert launched.returncode == plain.returncode == 1
    assert launched.stderr.split(": ", 1)[1] == plain.stderr.split(": ", 1)[1]


@pytest.mark.slow
def test_classes_defined_in_the_script_pickle_under_spawn():
    plain = run_python(SCRIPTS / "spawn_pickle.py")
    launched = run_python("-m", "autogaudi", "--quiet", SCRIPTS / "spawn_pickle.py")
    assert plain.returncode == 0, plain.stderr
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == plain.stdout == "140.0\n"


def test_help_lists_options_and_every_unit():
    result = run_python("-m", "autogaudi", "--help")
    assert result.returncode == 0
    from autogaudi.core.options import OPTIONS
    from autogaudi.core.registry import UNITS

    for option in OPTIONS:
        assert option.flag in result.stdout and option.env in result.stdout
    for unit in UNITS:
        assert unit.name in result.stdout and unit.summary in result.stdout


def test_version():
    result = run_python("-m", "autogaudi", "--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"autogaudi {__version__}")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--device", "tpu"], "valid choices for device: auto, hpu, cuda, cpu"),
        (["--disable", "nonsense"], "valid choices for disable: gpu_migration, hpu_mode, step_marks"),
        (["--log-every", "-1"], "must be a whole number >= 0"),
        (["--trial", "pin_memory"], "valid choices for trial: graph_capture, channels_last, fused_optimizer, hpu_mode"),
        (["--trial", "graph_capture", "--no-trials"], "no_trials rules out; choose one"),
        ([], "give a script to run"),
    ],
)
def test_bad_options_fail_before_the_script_starts(args, message):
    result = run_python("-m", "autogaudi", *args, *([SCRIPTS / "show_main.py"] if args else []))
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""  # the script never ran


def test_a_launch_without_options_builds_no_parser_and_still_reads_the_environment():
    """The parser's construction is a cost of every start: built only for options to read or an error to say."""
    code = (
        "import runpy, sys\n"
        "import autogaudi.entry.launcher as launcher\n"
        "def refused():\n"
        "    raise AssertionError('the parser was built')\n"
        "launcher.build_parser = refused\n"
        f"sys.argv = ['autogaudi', {str(SCRIPTS / 'show_main.py')!r}]\n"
        "runpy.run_module('autogaudi', run_name='__main__', alter_sys=True)\n"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr
    assert observed(result)["autogaudi_env"] == "1"
    bad = run_python("-m", "autogaudi", SCRIPTS / "show_main.py", env={**clean_env(), "AUTOGAUDI_DEVICE": "tpu"})
    assert (bad.returncode, bad.stdout) == (2, "")
    assert "valid choices for AUTOGAUDI_DEVICE: auto, hpu, cuda, cpu" in bad.stderr


@pytest.mark.parametrize(
    "command, abbreviation",
    [
        ([], "--exact-rand"),
        ([], "--no-tri"),
        (["cache", "list"], "--cache"),
        (["doctor"], "--fail"),
    ],
)
def test_an_abbreviated_option_is_refused_by_name(command, abbreviation):
    result = run_python("-m", "autogaudi", *command, abbreviation, SCRIPTS / "show_main.py")
    assert result.returncode == 2
    assert f"unrecognized arguments: {abbreviation}" in result.stderr
    assert result.stdout == ""  # the script never ran


def test_our_flags_stop_at_the_script_name():
    assert split_command_line(["--quiet", "train.py", "--quiet", "-m", "x"], VALUE_FLAGS) == (
        ["--quiet"],
        "train.py",
        ["--quiet", "-m", "x"],
        False,
    )
    assert split_command_line(["--device", "cpu", "-m", "pkg.mod", "--device", "hpu"], VALUE_FLAGS) == (
        ["--device", "cpu"],
        "pkg.mod",
        ["--device", "hpu"],
        True,
    )
    assert split_command_line(["-mpkg", "a"], VALUE_FLAGS) == ([], "pkg", ["a"], True)
    assert split_command_line(["--", "-weird.py", "a"], VALUE_FLAGS) == ([], "-weird.py", ["a"], False)


def test_cli_options_reach_child_processes(tmp_path):
    child = tmp_path / "child.py"
    child.write_text("import os; print(os.environ['AUTOGAUDI_LOG_EVERY'], os.environ['AUTOGAUDI'])\n")
    parent = tmp_path / "parent.py"
    parent.write_text(f"import subprocess, sys\nsubprocess.run([sys.executable, {str(child)!r}], check=True)\n")
    result = run_python("-m", "autogaudi", "--log-every", "7", "--quiet", parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["7", "1"]
    assert os.environ.get("AUTOGAUDI_LOG_EVERY") is None


def test_a_process_launcher_s_own_process_runs_without_autogaudi_and_hands_it_to_its_workers():
    """torchrun's agent only starts and watches workers: a session there would patch torch for nothing."""
    code = (
        "import json, os, runpy, sys\n"
        "sys.argv = ['autogaudi', '-m', 'torch.distributed.run', '--help']\n"
        "try:\n"
        "    runpy.run_module('autogaudi', run_name='__main__', alter_sys=True)\n"
        "except SystemExit:\n"
        "    pass\n"
        "import autogaudi\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'enabled': autogaudi.is_enabled(),"
        " 'workers_get': os.environ.get('AUTOGAUDI')}))\n"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {"torch": True, "enabled": False, "workers_get": "1"}


def test_syntax_error_in_the_script_reads_as_plain_pythons(tmp_path):
    (tmp_path / "bad.py").write_text("print('never')\nx = (1,\n")
    plain = run_python("bad.py", cwd=tmp_path)
    launched = run_python("-m", "autogaudi", "bad.py", cwd=tmp_path)
    assert plain.returncode == 1
    assert (launched.returncode, launched.stdout, launched.stderr) == (plain.returncode, plain.stdout, plain.stderr)
