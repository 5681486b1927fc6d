"""Which ``python *args`` runs the pre-started interpreter (:mod:`tests.prestarted`) may fork: only
those a fork cannot be told from a real interpreter by, and per which server (:func:`fingerprint`).

A PYTHONPATH entry acts at start-up only through ``sitecustomize`` (the child imports it as ``site``
does) or ``usercustomize`` (refused); ``.pth`` files are read in site directories only, never on
PYTHONPATH, so a folder holding one (this checkout) is forked.
A dist-info's entry points act where they are looked up: torch's device backends (the HPU double's
autoload) at the end of torch's import, which the child does from its own path as torch would.
"""

import os
import re
from pathlib import Path

# Variables read while the interpreter starts or torch (with Dynamo, numpy) is imported: a run whose
# values differ from a server's is forked by another server, started with them. The bridge's (PT_HPU_*,
# the double's release) are read by the bridge, which only a run's own torch import loads.
IMPORT_TIME_PREFIXES = (
    "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH", "PYTORCH", "PYTHON", "LD_", "CUDA", "NVIDIA",
    "NUMPY", "TRITON", "LANG", "LC_", "MALLOC", "GLIBC",
)  # fmt: skip


def fingerprint(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k != "PYTHONPATH" and k.startswith(IMPORT_TIME_PREFIXES)))


def _source_refuses(text: str) -> str | None:
    if "torch" not in text:
        return "no_torch"
    if re.search(r"\bgc\b", text):  # the server's objects are frozen out of the collector's view
        return "names_gc"
    return None


# Entry-point groups read where they are used, from the run's own path: torch's device backends at the
# end of its import (the pre-started interpreter's child loads them then) and Dynamo's backends.
LOOKED_UP_AT_USE = {"torch.backends", "torch_dynamo_backends"}


def _looked_up_at_use(dist_info: Path) -> bool:
    """Whether the package's entry points (the HPU double's) are all of groups read only where used."""
    points = dist_info / "entry_points.txt"
    groups = re.findall(r"^\[([^\]]+)\]", points.read_text(), re.M) if points.is_file() else []
    return set(groups) <= LOOKED_UP_AT_USE


def _module_file(name: str, folders: list) -> Path | None:
    parts = name.split(".")
    for folder in folders:
        base = Path(folder).joinpath(*parts)
        for candidate in (base / "__main__.py", base.with_suffix(".py")):
            if candidate.is_file():
                return candidate
    return None


def route(args: list, env: dict, cwd) -> str | None:
    """None where the pre-started interpreter runs ``python *args`` as a real one would; otherwise why not."""
    if env.get("AUTOGAUDI") is not None:
        return "autogaudi_set"
    where = Path(cwd) if cwd is not None else Path.cwd()
    if not where.is_dir():
        return "no_cwd"
    entries = env["PYTHONPATH"].split(os.pathsep) if env.get("PYTHONPATH") else []
    for entry in entries:
        folder = where / entry
        if not entry or not folder.is_dir():
            return "pythonpath"
        if (folder / "usercustomize.py").exists() or not all(map(_looked_up_at_use, folder.glob("*.dist-info"))):
            return "pythonpath_acts_at_start"
    if not args:
        return "interpreter_flags"
    try:
        os.fstat(0)
    except OSError:
        return "no_stdin"
    if args[0] == "-c" and len(args) > 1:
        return _source_refuses(args[1])
    if args[0:2] == ["-m", "autogaudi"]:
        return None  # its wait for the script's import of torch is kept: torch is hidden until then
    if args[0] == "-m" and len(args) > 1:
        found = _module_file(args[1], [where, *(where / e for e in entries)])
        if found is None:
            return "module_not_local"
        return _source_refuses(found.read_text(errors="replace"))
    if args[0].startswith("-"):
        return "interpreter_flags"
    script = where / args[0]
    if not script.is_file() or not script.name.endswith(".py"):
        return "not_a_script_file"
    return _source_refuses(script.read_text(errors="replace"))
