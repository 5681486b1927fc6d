"""Lazy or eager on a Gaudi, measured and remembered per script: the mechanisms, torch-free (they run
before the bridge loads, :mod:`autogaudi.entry.before_bridge`); the decision's unit is
:mod:`.unit`.

Why: the bridge reads ``PT_HPU_LAZY_MODE`` once, when it loads, and which mode is faster depends on
the model (lazy fuses a whole step into one graph; eager with torch.compile runs what is not compiled
op by op). No documented rule says which wins for a script. So where a script qualifies for both, a
run in one mode records its steady step time, the next run tries the other mode, and from then on
the faster is set, both figures kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from autogaudi.store.cache import ONE_OFFS

VARIABLE = "PT_HPU_LAZY_MODE"
MODES = ("lazy", "eager")
# What ties a script to one mode: HPU graphs are lazy-only, the script's own torch.compile eager-only.
_LAZY_ONLY = re.compile(r"\b(wrap_in_hpu_graph|ModuleCacher|hpu\.graphs)\b")
_EAGER_ONLY = re.compile(r"\btorch\.compile\(|\.compile\(")


def value(mode: str) -> str:
    return "1" if mode == "lazy" else "0"


def tied_to(source: str):
    """The mode a script's source ties it to (``"lazy"``/``"eager"``), or None where it runs in both."""
    lazy, eager = bool(_LAZY_ONLY.search(source)), bool(_EAGER_ONLY.search(source))
    return "lazy" if lazy else "eager" if eager else None


def record_path(cache, script: str) -> str:
    digest = hashlib.sha256(os.path.abspath(script).encode()).hexdigest()[:20]
    # measured step times, kept beside the capture one-offs measured on this machine
    return os.path.join(cache.folder(ONE_OFFS, "hpu_mode"), digest + ".json")


def read_record(cache, script: str) -> dict:
    """``{"lazy": ms per step or None, "eager": ...}`` remembered for ``script``."""
    try:
        with open(record_path(cache, script), encoding="utf-8") as handle:
            found = json.load(handle)
    except (OSError, ValueError):
        found = {}
    return {mode: found.get(mode) for mode in MODES}


def remember(cache, script: str, mode: str, ms_per_step: float) -> dict:
    record = read_record(cache, script)
    record[mode] = round(ms_per_step, 3)
    cache.write_json(record_path(cache, script), record)
    return record


def choose(record: dict):
    """(mode to set, reason code): the faster where both are measured, the one not yet measured where
    one is, (None, "first_run") where none is (the release's default runs and is measured)."""
    measured = [mode for mode in MODES if record.get(mode)]
    if len(measured) == 2:
        return min(MODES, key=lambda mode: record[mode]), "remembered_faster"
    if len(measured) == 1:
        return next(mode for mode in MODES if mode not in measured), "trying_other"
    return None, "first_run"


def decide(cache, script, source: str, bridge_loaded: bool, asked: bool) -> dict:
    """What to set ``PT_HPU_LAZY_MODE`` to before the bridge loads, and why (``code``); sets it. Only
    where ``asked`` (``--trial hpu_mode``): the modes round differently, and which one a run gets would
    hang on the cache's state and on step times the machine's load moves."""
    if VARIABLE in os.environ:
        return {"code": "set_by_environment", "mode": "lazy" if os.environ[VARIABLE] != "0" else "eager"}
    if not asked:
        return {"code": "changes_numbers"}
    if cache is None or script is None:
        return {"code": "no_cache" if cache is None else "no_script"}
    tied = tied_to(source)
    if tied is not None:
        return {"code": "script_tied", "mode": tied}
    if bridge_loaded:
        return {"code": "bridge_loaded_first"}
    record = read_record(cache, script)
    mode, code = choose(record)
    if mode is not None:
        os.environ[VARIABLE] = value(mode)
    return {"code": code, "mode": mode, "set": mode is not None, "record": record}
