"""Whatever way a script ends, autogaudi leaves the user's files as plain PyTorch would, gives plain's
output and exit code, and the next run is correct.

Each cell runs tests/scripts/exits.py in a project folder that holds the user's own files, plain and
then under ``python -m autogaudi`` with a cache, each from the same starting folder; then runs it again
under autogaudi, ending normally, with the cache the ended run left."""

import hashlib
import os
import shutil

import pytest
import torch

from tests.helpers import SCRIPTS, clean_env, run_python

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
    assert again.stdout == run_python("train.py", env={**env, "EXIT": "normal"}, cwd=project).stdout
    assert "report (torch" in again.stderr
    assert {name: (project / name).read_bytes() for name in USERS_FILES} == USERS_FILES
    leftovers = [name for name in os.listdir(temporary) if name.startswith("autogaudi")]
    assert leftovers == []  # no folder of autogaudi's left behind, however the run before ended
