"""The code is linted and formatted as pyproject.toml's [tool.ruff] says: `ruff check` and
`ruff format --check` are clean (run `ruff format . && ruff check --fix .` to get there); and the
package stays a house one can read: no module over 500 lines, no module docstring that grows into
the unit's documentation page (docs/ holds those)."""

import ast
import re
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["check", "format"])
def test_ruff_is_clean(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, str(REPO)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


MODULES = sorted((REPO / "autogaudi").rglob("*.py"))
MAX_LINES = 500  # past this, a module is several things: split it into a package
MAX_DOCSTRING_LINES = 30  # why, in a few lines; how and what was measured live in docs/


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(REPO)))
def test_a_module_is_short_and_its_docstring_says_why_in_a_few_lines(path):
    text = path.read_text()
    assert text.count("\n") <= MAX_LINES
    docstring = ast.get_docstring(ast.parse(text), clean=False) or ""
    assert docstring.count("\n") < MAX_DOCSTRING_LINES


# Where a change was asked for belongs to the project's history, not to the code or its pages.
ISSUE_NUMBER = re.compile(r"\b(issues?|PR) #?[0-9]+\b", re.IGNORECASE)
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *MODULES]


@pytest.mark.parametrize("path", PAGES, ids=lambda path: str(path.relative_to(REPO)))
def test_no_issue_numbers_in_the_code_the_readme_or_the_docs(path):
    assert not ISSUE_NUMBER.findall(path.read_text())
