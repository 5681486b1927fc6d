"""What must be decided before the Gaudi bridge loads, decided without torch.

Why: the bridge reads its settings once, when it loads (``PT_HPU_GPU_MIGRATION``, the recipe cache
``PT_HPU_RECIPE_CACHE_CONFIG``), and since torch 2.5 ``import torch`` itself loads it (the
``torch.backends`` entry point, "PyTorch Autoloading"); a script of Gaudi's own imports the bridge
before torch. So these are decided at the start of whichever comes first, the user's import of
torch or of the bridge (:func:`autogaudi.entry.runtime.enable_with_source` watches both), from the
options and the script's source: nothing here imports torch. By then ``__main__`` is the script,
whichever entry point enabled autogaudi (launcher, ``AUTOGAUDI=1``, ``enable()`` before torch).
``enable()`` after the bridge has loaded decides too, and finds it too late: gpu_migration reports
``bridge_loaded_first`` and the cache notes ``recipe_cache_not_set``, each with its fix.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from autogaudi.entry.main_script import script_path
from autogaudi.store.cache import RECIPE_CACHE, Cache, compile_cache_environment, note

BRIDGE = "habana_frameworks.torch"
MIGRATION_VARIABLE = "PT_HPU_GPU_MIGRATION"
MIGRATION_TOOLKIT = "habana_frameworks.torch.gpu_migration"


def bridge_loaded() -> bool:
    return BRIDGE in sys.modules


def bridge_installed() -> bool:
    return importlib.util.find_spec("habana_frameworks") is not None


def decide(options) -> dict:
    """``{"caches": ..., "migration": ...}``: the cache folder opened and the compile caches pointed
    into it (:func:`open_caches`), and gpu_migration's decision (:func:`switch_on_migration`)."""
    caches = open_caches(options)
    try:
        migration = None if options.unit_switched_off("gpu_migration") else switch_on_migration(options)
    except Exception as error:  # fail open: the script runs as written
        migration = {"error": repr(error)}
    try:
        mode = None if options.unit_switched_off("hpu_mode") else choose_hpu_mode(options, caches)
    except Exception as error:  # fail open: the release's default mode
        mode = {"code": "error", "error": repr(error)}
    LAST_MODE.clear()
    LAST_MODE.update(mode or {})  # switched off: the unit is not applied, the core's row says so
    return {"caches": caches, "migration": migration}


# The hpu_mode unit's decision, as the latest decide() took it (the unit reads it once torch is in).
LAST_MODE: dict = {}


def choose_hpu_mode(options, caches: dict):
    """Lazy or eager for this run (:mod:`autogaudi.optimizations.hpu_mode.modes`), set before the bridge
    reads it; a variable autogaudi set goes in ``caches["set"]``, taken back off at the run's end."""
    if options.device not in ("auto", "hpu") or not bridge_installed():
        return {"code": "other_device"}
    from autogaudi.optimizations.hpu_mode import modes  # where a bridge can load: not a CPU start's cost

    path = script_path()
    source = ""
    if path is not None:
        with open(path, encoding="utf-8", errors="replace") as handle:
            source = handle.read()
    decided = modes.decide(caches["cache"], path, source, bridge_loaded(), asked="hpu_mode" in options.trial)
    if decided.get("set"):
        caches["set"][modes.VARIABLE] = os.environ[modes.VARIABLE]
    return decided


def open_caches(options) -> dict:
    """The cache folder (``cache``, or None), the compile caches pointed into it where the
    environment does not name theirs already (``compile``: variable -> {"value", "set_by"}; the
    user's setting, or a parent process's, is never overridden), the variables set (``set``, for
    the session to take back off) and ``notes``. A folder that is not autogaudi's, or that another
    user could have written, is not used: the run goes on without it and the notes say why."""
    opened = {"cache": None, "compile": {}, "set": {}, "notes": []}
    try:
        cache = Cache.for_options(options)
        if cache is None:
            return opened
        refused = cache.refusal()
        if refused:
            opened["notes"].append(note("cache_refused", why=refused))
            return opened
        untrusted = cache.distrust()  # before anything is written there, the tag included
        if untrusted:
            opened["notes"].append(note("cache_untrusted", why=untrusted))
            return opened
        cache.claim()
        opened["cache"] = cache
        bridge = options.device in ("auto", "hpu") and bridge_installed()
        for name, value in compile_cache_environment(cache, bridge).items():
            if name in os.environ:
                opened["compile"][name] = {"value": os.environ[name], "set_by": "environment"}
            elif name == RECIPE_CACHE and bridge_loaded():
                opened["notes"].append(note("recipe_cache_not_set", variable=name))
            else:
                os.environ[name] = value
                opened["set"][name] = value
                opened["compile"][name] = {"value": value, "set_by": "autogaudi"}
    except Exception as error:  # an unwritable home folder: the run goes on without a cache
        opened["cache"] = None
        opened["notes"].append(note("cache_not_used", error=error))
    return opened


def switch_on_migration(options) -> dict:
    """Switch Intel's GPU migration toolkit on for a CUDA script, before the bridge loads; what was
    decided (``switched_on_by``: ``autogaudi``, ``environment`` or None with ``why_not``, a reason
    code of the gpu_migration unit)."""
    if MIGRATION_TOOLKIT in sys.modules or os.environ.get(MIGRATION_VARIABLE) == "1":
        return {"switched_on_by": "environment"}
    if options.device not in ("auto", "hpu"):
        return {"switched_on_by": None, "why_not": "other_device"}
    if options.exact:
        return {"switched_on_by": None, "why_not": "exact"}
    if not bridge_installed():
        return {"switched_on_by": None, "why_not": "no_bridge"}
    if bridge_loaded():
        return {"switched_on_by": None, "why_not": "bridge_loaded_first"}
    path = script_path()
    if path is None:
        return {"switched_on_by": None, "why_not": "no_script"}
    from autogaudi.entry.script_source import read_script  # where a bridge can load: not a CPU start's cost

    found = read_script(path)
    if not found["cuda"]:
        return {"switched_on_by": None, "why_not": "script_not_cuda", **found}
    os.environ[MIGRATION_VARIABLE] = "1"
    return {"switched_on_by": "autogaudi", **found}
