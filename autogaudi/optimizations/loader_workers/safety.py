"""Whether a loader's dataset may leave the main process: what its ``__getitem__`` changes (the
global random streams, the dataset's own attributes), a random generator it holds, and, under the
spawn and forkserver start methods, whether the script's ``__main__`` re-runs safely in each worker
and the dataset pickles. Each check is a plain function the unit asks before any worker starts."""

from __future__ import annotations

import ast
import collections
import io
import itertools
import multiprocessing
import os
import random
import sys
from multiprocessing.reduction import ForkingPickler
from types import FunctionType

import torch
from torch.utils.data import Dataset

SPAWNING = ("spawn", "forkserver")  # start methods whose workers are fresh interpreters


def random_state() -> tuple:
    """Everything ``__getitem__`` could draw random numbers from in this process."""
    numpy = sys.modules.get("numpy")
    return (
        torch.random.get_rng_state(),
        random.getstate(),
        numpy.random.get_state()[1].tobytes() if numpy is not None else None,
    )


def same_random_state(first: tuple, second: tuple) -> bool:
    return torch.equal(first[0], second[0]) and first[1:] == second[1:]


def _datasets(dataset) -> list:
    """The dataset and the datasets it holds directly (a Subset's, a ConcatDataset's)."""
    found = [dataset]
    for value in vars(dataset).values() if hasattr(dataset, "__dict__") else ():
        items = value if isinstance(value, (list, tuple)) else (value,)
        found.extend(item for item in items[:64] if isinstance(item, Dataset))
    return found


def _generator_types() -> tuple:
    numpy = sys.modules.get("numpy")
    extra = (numpy.random.RandomState, numpy.random.Generator) if numpy is not None else ()
    return (random.Random, torch.Generator, *extra)


def held_generator(dataset):
    """The type name of a random generator the dataset holds (in an attribute, in a container or an
    object one attribute down: a transform's), or None. Workers would each draw from a copy."""
    kinds = _generator_types()

    def found(value, depth):
        if isinstance(value, kinds):
            return type(value).__name__
        if isinstance(value, (list, tuple, set, dict)):
            items = value.values() if isinstance(value, dict) else value
            return next((hit for item in itertools.islice(items, 64) if (hit := found(item, depth))), None)
        if depth and hasattr(value, "__dict__") and not isinstance(value, (type, torch.Tensor)):
            return next((hit for item in vars(value).values() if (hit := found(item, depth - 1))), None)
        return None

    return next((hit for part in _datasets(dataset) if (hit := found(part, 2))), None)


def _fingerprint(value):
    """What changes when ``__getitem__`` counts or caches into an attribute, at the cost of a len()."""
    if isinstance(value, (bool, int, float, complex, type(None))):
        return repr(value)
    if isinstance(value, (str, bytes)):
        return len(value), hash(value)
    if type(value) in (list, dict, set, collections.deque, collections.OrderedDict, collections.defaultdict):
        small = len(value) <= 32
        items = value.items() if isinstance(value, dict) else ()
        ids = tuple((key, id(item)) for key, item in items) if small and items else None
        if small and not isinstance(value, (dict, set)):
            ids = tuple(map(id, value))
        return id(value), len(value), ids
    return id(value)


def instance_state(dataset) -> dict:
    """The dataset's attributes (and its inner datasets'), one level deep, as fingerprints."""
    return {
        (index, name): _fingerprint(value)
        for index, part in enumerate(_datasets(dataset))
        for name, value in (vars(part).items() if hasattr(part, "__dict__") else ())
    }


def changed_attribute(before: dict, after: dict):
    """The first attribute whose fingerprint differs, or None."""
    changed = [
        name for (index, name) in before.keys() | after.keys() if before.get((index, name)) != after.get((index, name))
    ]
    return min(changed, default=None)


def start_method(loader) -> str:
    """The start method the loader's workers would get, read without fixing the global one (which
    a script may still set)."""
    if loader.multiprocessing_context is not None:
        return loader.multiprocessing_context.get_start_method()
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def reimported_main():
    """The file a spawned worker re-runs as ``__mp_main__`` (multiprocessing.spawn's rule: the
    module ``__main__`` was run as, else its file), or None where none is re-run."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return None if name == "__main__" or name.endswith(".__main__") else main.__spec__.origin
    return getattr(main, "__file__", None)


def _is_main_guard(test) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.dump(test.left), ast.dump(test.comparators[0])}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}


def _defines_only(node) -> bool:
    """Whether a top-level statement only defines or imports when the module is re-run in a worker:
    the rest (training, argparse, set_start_method) belongs under ``if __name__ == "__main__":``."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Pass)):
        return True
    if isinstance(node, ast.Expr):
        return isinstance(node.value, ast.Constant)  # a docstring
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        calls = (ast.Call, ast.Subscript, ast.Await, ast.Yield, ast.YieldFrom, ast.NamedExpr)
        return node.value is None or not any(isinstance(part, calls) for part in ast.walk(node.value))
    if isinstance(node, ast.If):
        return _is_main_guard(node.test) and all(map(_defines_only, node.orelse))
    if isinstance(node, ast.Try):  # try: import x / except ImportError: ...
        blocks = [node.body, node.orelse, node.finalbody, *(handler.body for handler in node.handlers)]
        return all(_defines_only(statement) for block in blocks for statement in block)
    return False


def main_reruns_safely(path: str) -> bool:
    """Whether re-running the script at ``path`` in a worker only defines and imports."""
    try:
        with open(path, "rb") as source:
            tree = ast.parse(source.read(), path)
    except (OSError, SyntaxError, ValueError):
        return False
    return all(map(_defines_only, tree.body))


class _MainReference(Exception):
    pass


def pickling_error(objects, main_reimported: bool):
    """Why ``objects`` would not reach a spawned worker (as ``repr``), or None. Pickled as the worker's
    start pickles them; where no ``__main__`` is re-run there, what ``__main__`` defines is missing."""

    class Pickler(ForkingPickler):
        def reducer_override(self, obj):
            if isinstance(obj, (type, FunctionType)) and obj.__module__ == "__main__":
                raise _MainReference(f"{obj.__qualname__} is defined in __main__, which the workers do not import")
            return NotImplemented

    pickler = (ForkingPickler if main_reimported else Pickler)(io.BytesIO(), 4)
    try:
        pickler.dump(objects)
    except Exception as error:
        return repr(error)
    return None


def rounds_otherwise_in_a_worker(dataset, threads: int) -> bool:
    """Whether the first sample comes out otherwise with one intra-op thread, as torch gives each
    worker, than with the main process's ``threads``: a ``__getitem__`` whose own torch reductions
    split across threads adds in another order. Built twice, once each way; called only for a dataset
    whose measured ``__getitem__`` drew no random numbers and changed no attribute. A dataset that has
    no first sample to build is not judged by it."""
    if threads <= 1:
        return False
    from autogaudi.measure.numerics import float_leaves
    from autogaudi.optimizations.loader_workers.thread_cut import with_threads

    try:  # each build with its thread count, torch's count put back as it was (cut, beside other workers)
        as_script = float_leaves(with_threads(threads)(dataset.__getitem__, (0,), {}))
        in_a_worker = float_leaves(with_threads(1)(dataset.__getitem__, (0,), {}))
    except Exception:
        return False
    return len(as_script) != len(in_a_worker) or not all(map(torch.equal, as_script, in_a_worker))


def why_not_workers(loader, threads: int):
    """(reason code, values) why this loader's dataset must stay in-process, or None: checked before
    any worker starts, in the main process running ``threads`` intra-op threads."""
    kind = held_generator(loader.dataset)
    if kind is not None:
        return "holds_generator", {"kind": kind}
    if rounds_otherwise_in_a_worker(loader.dataset, threads):
        return "rounds_otherwise", {"threads": threads}
    method = start_method(loader)
    if method not in SPAWNING:
        return None
    main = reimported_main()
    if main is not None and not main_reruns_safely(main):
        return "main_reruns", {"method": method, "file": os.path.basename(main)}
    error = pickling_error((loader.dataset, loader.collate_fn, loader.worker_init_fn), main is not None)
    return ("not_picklable", {"method": method, "error": error}) if error is not None else None
