"""docs/write-a-unit.md's unit, loaded from the page as it stands: registered for a tiny script, it
changes the loaders it says it changes, gives its code, is off under --exact, and disable() undoes it."""

import pathlib
import re
import sys

import pytest
from torch.utils.data import DataLoader

import autogaudi
from autogaudi.core import options, session
from autogaudi.core.registry import UNIT_NAMES, UNITS, UnitInfo

PAGE = pathlib.Path(__file__).parents[2] / "docs" / "write-a-unit.md"
NAME = "persistent_workers"


def unit_source() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    [source] = [block for block in blocks if "(Unit):" in block]
    return source


@pytest.fixture
def registered(tmp_path, monkeypatch):
    """The page's unit, a module of its own, as one more row of the registry."""
    (tmp_path / "page_unit.py").write_text(unit_source())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "page_unit", raising=False)
    info = UnitInfo(NAME, "DataLoader workers kept alive between epochs", "page_unit:PersistentWorkers")
    monkeypatch.setattr(session, "UNITS", (*UNITS, info))
    monkeypatch.setattr(options, "_parse_units", options._units_of((*UNIT_NAMES, NAME)))
    yield
    sys.modules.pop("page_unit", None)


def test_the_pages_unit_is_short():
    assert len(unit_source().splitlines()) < 100


def test_the_pages_unit_keeps_workers_where_the_script_did_not_choose_and_disable_undoes_it(registered):
    autogaudi.enable(device="cpu", only=NAME)
    unchosen = DataLoader(range(8), num_workers=2)
    chosen = DataLoader(range(8), num_workers=2, persistent_workers=False)
    in_process = DataLoader(range(8))
    assert (unchosen.persistent_workers, chosen.persistent_workers, in_process.persistent_workers) == (
        True,
        False,
        False,
    )
    row = autogaudi.report().unit(NAME)
    assert (row["status"], row["reason_code"], row["reason_params"]) == (
        "applied",
        "keeping_workers",
        {"backend": "cpu"},
    )
    assert row["figures"] == {"loaders_kept": 1}
    autogaudi.disable()
    assert DataLoader(range(8), num_workers=2).persistent_workers is False


def test_the_pages_unit_is_off_under_exact_for_the_random_draws_it_declares(registered):
    autogaudi.enable(device="cpu", only=NAME, exact=True)
    assert DataLoader(range(8), num_workers=2).persistent_workers is False
    row = autogaudi.report().unit(NAME)
    assert (row["status"], row["reason_code"]) == ("skipped", "not_exact")
