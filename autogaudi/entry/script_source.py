"""What a script and its own modules show of CUDA, read before the script runs (no torch).

Why: Intel's GPU migration toolkit must be switched on before the Gaudi bridge loads, which since
torch 2.5 is during the script's ``import torch``; the source is all there is to go by then
(:mod:`autogaudi.entry.before_bridge`). The gpu_migration unit reports what it found.
"""

from __future__ import annotations

import ast
import os
import re

# What in a script's source says it targets CUDA.
CUDA_USE = re.compile(r"""\.cuda\(|\btorch\.cuda\.|["']cuda(:\d+)?["']""")
# CUDA-bound libraries outside what the toolkit maps. The docs (docs.habana.ai, "GPU Migration
# Toolkit", latest as read 2026-11-26, software 1.19-1.23) list what it maps: torch.cuda, torch calls
# with GPU arguments, Apex (with limitations) and pynvml; these are CUDA kernels of their own, which
# it cannot map. Read, not run: no Gaudi was available.
NOT_MAPPED = {
    "triton": "Triton GPU kernels",
    "flash_attn": "FlashAttention's CUDA kernels",
    "xformers": "xFormers' CUDA kernels",
    "bitsandbytes": "bitsandbytes' CUDA kernels",
    "cupy": "CuPy arrays and kernels",
    "torch.utils.cpp_extension": "a CUDA extension built by the script",
}
_MAX_FILES = 32  # the script and at most this many of its own modules are read


def _imported_names(tree) -> list:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _own_folders(folder: str) -> list:
    """Where the user's own modules are found: the script's folder, then the ``PYTHONPATH`` entries
    the script lives under (a project run as ``PYTHONPATH=. python projects/x/train.py`` imports its
    package from its root; other entries hold libraries, not the user's code)."""
    entries = [os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return [folder, *(entry for entry in entries if folder.startswith(entry + os.sep))]


def _local_file(folders: list, name: str):
    for folder in folders:
        base = os.path.join(folder, *name.split("."))
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def read_script(path: str) -> dict:
    """What the script and its own modules (those of its folder or ``PYTHONPATH`` it imports,
    transitively) show:
    ``cuda`` (``file:line`` of the first uses of CUDA, at most 3) and ``not_mapped`` (library ->
    ``file:line`` of its first import), read before the script runs."""
    folder = os.path.dirname(os.path.abspath(path))
    folders = _own_folders(folder)
    pending, seen = [os.path.abspath(path)], set()
    found = {"cuda": [], "not_mapped": {}}
    while pending and len(seen) < _MAX_FILES:
        file = pending.pop(0)
        if file in seen:
            continue
        seen.add(file)
        try:
            with open(file, encoding="utf-8") as handle:
                source = handle.read()
            tree = ast.parse(source)
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
            continue
        where = os.path.relpath(file, folder)
        for number, line in enumerate(source.splitlines(), 1):
            if len(found["cuda"]) < 3 and CUDA_USE.search(line.split("#", 1)[0]):
                found["cuda"].append(f"{where}:{number}")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _imported_names(ast.Module(body=[node], type_ignores=[])):
                    library = next((lib for lib in NOT_MAPPED if name == lib or name.startswith(lib + ".")), None)
                    if library:
                        found["not_mapped"].setdefault(library, f"{where}:{node.lineno}")
        for name in _imported_names(tree):
            local = _local_file(folders, name)
            if local is not None:
                pending.append(local)
    return found
