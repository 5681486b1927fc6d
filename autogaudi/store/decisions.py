"""Remembered decisions: a run that matches an earlier one starts from what that one measured.

Why: the step profile and the trials cost steps (census steps run observed, a trial's arms run the
slower choice half the time) and the one-off of what they try; a rerun of the same script on the same
machine would measure the same. An entry is found by two keys. The *set-up* (a folder in the cache):
the script's path and content hash, the backend and device name, the torch and autogaudi versions and
the options that steer decisions. The *model* (a file in it): the training model's module types and
parameter shapes and dtypes, and the shapes of its inputs in the profiled step (positional inputs:
torch's global forward hooks do not see keyword arguments). The entry holds the step profile and
each unit's last trial, stamped with the run that decided it.

A run whose set-up has entries identifies its training model in one step after warm-up (forward
hooks only, no census); when the model's key has an entry, the step profiler hands out the
remembered profile and the trial units (graph_capture, channels_last, mixed_precision's speed trial)
follow their remembered decisions, each checked against the step time remembered for it
(:class:`autogaudi.measure.trials.Check`; tried again when it differs). On a distributed run rank 0 looks
up and writes; every rank follows its answer.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys

import torch

from autogaudi._version import __version__
from autogaudi.entry.ranks import is_rank_zero, rank_zero_choice
from autogaudi.store.cache import DECISIONS, SCHEMAS, note, now, problem, read_json

MEMORY_SUFFIX = ".memory"  # an out-of-memory decision's file, beside the entry (not one: no profile in it)
FORMAT = 1  # the layout of an entry; entries of another layout are ignored, with a note
# Options that do not steer any decision (what the report shows, where the cache is): a run that
# differs only in them finds the same entries.
NOT_DECIDING = frozenset(
    {"report", "verbose", "quiet", "log_every", "cache_dir", "no_cache", "cache_max_mb", "cache_trust_shared"}
)


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:20]


def script_identity():
    """The ``__main__`` script's real path and content hash, or None (no script file: ``-c``, a REPL)."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not os.path.isfile(path):
        return None
    with open(path, "rb") as handle:
        content = hashlib.sha256(handle.read()).hexdigest()
    return {"path": os.path.realpath(path), "sha256": content}


def model_structure(module) -> list:
    """Module types by name, and parameters' shapes, dtypes and whether they train."""
    modules = [[name, f"{type(sub).__module__}.{type(sub).__qualname__}"] for name, sub in module.named_modules()]
    params = [[name, list(p.shape), str(p.dtype), p.requires_grad] for name, p in module.named_parameters()]
    return modules + params


class Memory:
    """The decisions of runs with this process's set-up, in ``cache``."""

    def __init__(self, cache, backend, options):
        self.cache = cache
        self.notes: list = []  # what was ignored, as the cache's notes (autogaudi.store.cache.NOTES)
        self.script = script_identity()
        self._backend = backend
        self._options = {name: value for name, value in options.as_dict().items() if name not in NOT_DECIDING}
        self.recalled = None  # the entry this run follows, once found
        self._path = None  # the entry this run writes
        self._model = None  # the training model's class name (the model itself may be gone by exit)
        self._written = None

    @functools.cached_property
    def setup(self) -> dict:
        """What a decision depends on besides the model: the script, backend, device, versions and
        options. Built at first use, not at start."""
        setup = {
            "format": FORMAT,
            "script": self.script,
            "backend": self._backend.name,
            "device": self._backend.device_key(),
            "torch": torch.__version__,
            "autogaudi": __version__,
            "options": self._options,
        }
        return json.loads(json.dumps(setup, default=str))  # as an entry holds it (lists, not tuples)

    @property
    def folder(self) -> str:
        return os.path.join(self.cache.root, DECISIONS, digest(self.setup))

    def has_entries(self) -> bool:
        """Whether earlier runs with this set-up left entries (rank 0's answer on every rank)."""
        found = (
            self.script is not None
            and self.cache.trusted()  # checked at every read: the folder may have been swapped since
            and os.path.isdir(self.folder)
            and any(name.endswith(".json") and not name.startswith(".") for name in os.listdir(self.folder))
        )
        return bool(rank_zero_choice(found))

    def recall(self, model, inputs):
        """The entry for ``model`` called with ``inputs`` (shapes), or None; rank 0's on every rank."""
        self._path = self._entry_path(model, inputs) if model is not None else None
        entry = self._read(self._path) if self._path is not None and is_rank_zero() else None
        self.recalled = rank_zero_choice(entry)
        return self.recalled

    def _entry_path(self, model, inputs) -> str:
        return os.path.join(self.folder, digest({"model": model_structure(model), "inputs": inputs}) + ".json")

    def _read(self, path: str):
        if not self.cache.trusted() or not os.path.exists(path):
            return None
        entry = read_json(path)
        if entry is None:
            self.notes.append(note("entry_unreadable", path=path))
            return None
        if entry.get("format") != FORMAT or entry.get("setup") != self.setup:
            setup = entry.get("setup")
            version = setup.get("autogaudi") if isinstance(setup, dict) else None
            self.notes.append(note("entry_other_setup", format=entry.get("format"), version=version, path=path))
            return None
        invalid = problem(entry, SCHEMAS["decisions"])
        if invalid:
            self.notes.append(note("entry_invalid", problem=invalid, path=path))
            return None
        return entry

    def remember(self, profile, trials: dict) -> None:
        """Write (rank 0) what this run decided: its profile and each unit's last trial, each stamped
        with the run that measured it (a remembered profile or trial keeps its stamp)."""
        if self.script is None or not is_rank_zero():
            return
        if self._model is None:  # first written while the model is alive: the profile has just been published
            if profile.model is None:
                return
            self._model = type(profile.model).__name__
            self._path = self._path or self._entry_path(profile.model, profile.inputs)
        before = self.recalled or {}
        runs = before.get("runs", 0) + 1
        stamp = {"run": runs, "date": (self._written or {}).get("last_run_on") or now()}
        entry = {
            "format": FORMAT,
            "setup": self.setup,
            "script": self.script["path"],
            "argv": sys.argv[1:],
            "model": self._model,
            "backend": self.setup["backend"],
            "device": self.setup["device"],
            "profile": profile.remembered or {**profile.as_record(), **stamp},
            "trials": {**before.get("trials", {}), **{name: {**trial, **stamp} for name, trial in trials.items()}},
            "runs": runs,
            "last_run_on": stamp["date"],
        }
        if entry == self._written:
            return
        self.cache.write_json(self._path, entry)
        self._written = entry

    def _memory_path(self, model, inputs) -> str:
        return os.path.join(self.folder, digest({"model": model_structure(model), "inputs": inputs}) + MEMORY_SUFFIX)

    def recall_memory(self, model, inputs):
        """What an earlier run that ran out of memory with ``model`` called with ``inputs`` (shapes)
        decided for the next one, or None; rank 0's on every rank. Read at the model's first call,
        before the step profile's key exists: a step that runs out of memory may never be profiled."""
        if self.script is None:
            return None
        path = self._memory_path(model, inputs)
        record = None
        if is_rank_zero() and self.cache.trusted() and os.path.exists(path):
            record = read_json(path)
            invalid = "unreadable" if record is None else problem(record, SCHEMAS["memory_decision"])
            if not invalid and record.get("setup") != self.setup:
                invalid = "another set-up"
            if invalid:
                self.notes.append(note("entry_invalid", problem=invalid, path=path))
                record = None
        return rank_zero_choice(record)

    def remember_memory(self, model, inputs, decision: dict) -> None:
        """Write (rank 0) what the next run with ``model`` and ``inputs`` does from its first step."""
        if self.script is None or not is_rank_zero():
            return
        record = {"format": FORMAT, "setup": self.setup, "model": type(model).__name__, **decision, "date": now()}
        self.cache.write_json(self._memory_path(model, inputs), record)


def origin(record: dict) -> dict:
    """The run that measured a remembered profile or trial: {"run": n, "date": "..."}."""
    return {"run": record.get("run"), "date": record.get("date")}
