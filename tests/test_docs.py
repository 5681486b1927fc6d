"""Docs that are generated from code must match it."""
import importlib.util

from tests.helpers import REPO


def test_options_page_is_generated_from_the_options():
    spec = importlib.util.spec_from_file_location("gen_options", REPO / "docs" / "gen_options.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert (REPO / "docs" / "options.md").read_text() == generator.render(), "run: python docs/gen_options.py"
    readme = (REPO / "README.md").read_text()
    assert generator.readme_with_table(readme) == readme, "run: python docs/gen_options.py"


def test_every_unit_has_a_page_and_a_readme_row():
    from autogaudi.registry import UNITS

    readme = (REPO / "README.md").read_text()
    for unit in UNITS:
        assert (REPO / "docs" / "units" / f"{unit.name}.md").is_file()
        assert f"[`{unit.name}`](docs/units/{unit.name}.md)" in readme
