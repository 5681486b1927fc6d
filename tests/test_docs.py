"""Docs that are generated from code must match it."""

import importlib.util

from tests.helpers import REPO


def _generator():
    spec = importlib.util.spec_from_file_location("gen_reference", REPO / "docs" / "gen_reference.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    return generator


def test_options_page_is_generated_from_the_options():
    generator = _generator()
    assert (REPO / "docs" / "options.md").read_text() == generator.render(), "run: python docs/gen_reference.py"


def test_reason_codes_page_is_generated_from_the_tables():
    page = (REPO / "docs" / "reasons.md").read_text()
    assert page == _generator().render_reasons(), "run: python docs/gen_reference.py"


def test_the_readme_is_a_front_page_with_no_issue_numbers():
    import re

    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    pages = [readme] + [path.read_text() for path in (REPO / "docs").rglob("*.md")]
    assert not [page for page in pages if re.search(r"\bissues? \d+", page)]


def test_every_unit_has_a_page_and_a_readme_row():
    from autogaudi.core.registry import UNITS

    readme = (REPO / "README.md").read_text()
    for unit in UNITS:
        assert (REPO / "docs" / "units" / f"{unit.name}.md").is_file()
        assert f"[`{unit.name}`](docs/units/{unit.name}.md)" in readme


def test_the_docs_build_with_every_page_in_the_nav_and_no_broken_link(tmp_path):
    import subprocess
    import sys

    import pytest

    pytest.importorskip("mkdocs")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "doctor" / "index.html").is_file()
