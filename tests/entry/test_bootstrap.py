"""AUTOGAUDI=1 without the launcher: the .pth file, the sitecustomize bootstrap, and child processes."""

import json
import subprocess
import sys

import pytest

from autogaudi.entry.paths import bootstrap_dir
from tests.helpers import SCRIPTS, clean_env, run_python

PROBE = (
    "import json, sys; import autogaudi.entry.runtime as r; "
    "print(json.dumps({'torch': 'torch' in sys.modules, 'enabled': r.is_enabled(), 'sources': r._STATE.sources}))"
)


def probe(env):
    result = run_python("-c", PROBE, env=env, fresh=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_env_var_enables_without_importing_torch():
    assert probe(clean_env(AUTOGAUDI="1")) == {"torch": False, "enabled": True, "sources": ["pth"]}


def test_unset_or_zero_does_nothing():
    for env in (clean_env(), clean_env(AUTOGAUDI="0"), clean_env(AUTOGAUDI="false")):
        result = run_python("-c", "import sys; print('autogaudi' in sys.modules)", env=env)
        assert result.stdout.strip() == "False"


@pytest.mark.slow
def test_bad_env_values_stop_a_process_at_its_torch_import_with_the_valid_choices():
    for bad in (dict(AUTOGAUDI="banana"), dict(AUTOGAUDI="1", AUTOGAUDI_DEVICE="tpu")):
        (name, value), *_ = reversed(bad.items())
        result = run_python("-c", "print('before'); import torch; print('ran')", env=clean_env(**bad))
        assert (result.returncode, result.stdout) == (2, "before\n")
        assert name in result.stderr and repr(value) in result.stderr and "valid choices" in result.stderr
        launched = run_python("-m", "autogaudi", SCRIPTS / "show_main.py", env=clean_env(**bad), fresh=True)
        assert (launched.returncode, launched.stdout) == (2, "")  # the launcher refuses before the script


def test_bad_env_values_leave_processes_without_torch_alone():
    plain_pip = run_python("-m", "pip", "--version").stdout
    for bad in (dict(AUTOGAUDI="2"), dict(AUTOGAUDI="1", AUTOGAUDI_PRECISION="bf17")):
        result = run_python("-c", "print('ran')", env=clean_env(**bad), fresh=True)
        assert (result.returncode, result.stdout, result.stderr) == (0, "ran\n", "")
        pip = run_python("-m", "pip", "--version", env=clean_env(**bad), fresh=True)
        assert (pip.returncode, pip.stderr, pip.stdout) == (0, "", plain_pip)


def test_sitecustomize_bootstrap_and_pth_enable_once():
    seen = probe(clean_env(AUTOGAUDI="1", PYTHONPATH=bootstrap_dir()))
    assert seen == {"torch": False, "enabled": True, "sources": ["pth", "sitecustomize"]}


def test_users_own_sitecustomize_still_runs_in_children(tmp_path):
    user_site = tmp_path / "site"
    user_site.mkdir()
    (user_site / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    child = (
        "import json, os, sys, sitecustomize, autogaudi; print(json.dumps("
        "[os.environ.get('USER_SITECUSTOMIZE'), sitecustomize.__file__, autogaudi.is_enabled()]))"
    )
    script = tmp_path / "parent.py"
    script.write_text(f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {child!r}], check=True)\n")
    result = run_python("-m", "autogaudi", "--quiet", script, env=clean_env(PYTHONPATH=user_site), fresh=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["ran", str(user_site / "sitecustomize.py"), True]


def test_env_only_process_reports_once_it_has_trained():
    trained = run_python(SCRIPTS / "train_tiny.py", env=clean_env(AUTOGAUDI="1"), fresh=True)
    assert trained.returncode == 0, trained.stderr
    assert "autogaudi 0.1.0 report" in trained.stderr and "10 training steps" in trained.stderr
    # A helper process (a DataLoader or compile worker, say) that never trains stays silent.
    idle = run_python(SCRIPTS / "train_tiny.py", env=clean_env(AUTOGAUDI="1", TRAIN="0"), fresh=True)
    assert (idle.returncode, idle.stderr) == (0, "")


def test_pth_file_and_options_agree_on_what_means_off():
    from autogaudi.core.options import _FALSE
    from tests.helpers import REPO

    line = (REPO / "autogaudi.pth").read_text()
    assert repr(_FALSE).replace("'", '"') in line


def test_interpreter_without_autogaudi_below_the_launcher_stays_silent(tmp_path):
    """A script's child on another interpreter (here the venv's base python, which lacks autogaudi)
    inherits AUTOGAUDI=1 and the bootstrap folder: its stderr is its own, unless --verbose."""
    other = getattr(sys, "_base_executable", None) or sys.executable
    lacks = subprocess.run([other, "-c", "import autogaudi"], cwd=tmp_path, env=clean_env(), capture_output=True)
    if other == sys.executable or lacks.returncode == 0:
        pytest.skip("no interpreter without autogaudi here")
    child = f"import subprocess, sys; r = subprocess.run([{other!r}, '-c', 'print(7)'], capture_output=True, text=True)"
    script = tmp_path / "parent.py"
    script.write_text(child + "\nprint(repr(r.stderr), r.returncode, r.stdout.strip())\n")
    quiet = run_python("-m", "autogaudi", "--quiet", script, env=clean_env(), cwd=tmp_path, fresh=True)
    assert (quiet.returncode, quiet.stdout) == (0, "'' 0 7\n"), quiet.stderr
    verbose = run_python("-m", "autogaudi", "--quiet", "--verbose", script, env=clean_env(), cwd=tmp_path, fresh=True)
    assert verbose.stdout != quiet.stdout and verbose.stdout.endswith(" 0 7\n")
