"""The code is linted and formatted as pyproject.toml's [tool.ruff] says: `ruff check` and
`ruff format --check` are clean (run `ruff format . && ruff check --fix .` to get there)."""

import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, str(REPO)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
