"""DataLoader worker processes, switched on only for a loader measured to starve the training step,
and only where workers give the batches, the numbers and the state the plain run has.

Why: with ``num_workers=0`` (the default) the training loop itself builds every batch, so the
device (or the compute threads) idle while ``__getitem__`` runs. Workers build batches in parallel.
But workers also cost: on a 2-core machine one worker was measured slower than none, and a compute-
bound step loses from the cores the workers take. So nothing is assumed: during the first epoch,
after two warm-up batches, autogaudi times 16 batches (6 when waiting already holds 80%) — time
waiting for the batch vs time between batches — and only when waiting is at least half of it does it
tune that loader at once: ``num_workers`` from the machine (physical cores per local rank, less one
for the main process, at least 2), ``prefetch_factor=2``, and the main process's intra-op threads
cut to the cores the workers leave free. The loader itself is not changed: from the batch after the
measured ones, and from each later epoch's second batch, the script's in-process iterator is routed
to a worker iterator fed from that epoch's own sampler iterator (:func:`workers_for_rest_of_epoch`),
so ``loader.num_workers`` and ``torch.get_num_threads()`` read what the script set. The next 16
batches are timed again, worker start-up included; if they did not come faster the loader goes back
in-process and the report says so.

Faithfulness: batches and their order are the same (the sampler still runs in the main process),
and the seed the worker iterator draws is undone, so the random stream is the plain run's. Workers
are not persistent on purpose: a DataLoader draws one seed from the global RNG per epoch either way,
while persistent workers would skip those draws from epoch 2 on (measured: 3e-2 loss drift). Kept
in-process, each with a reason code: a ``__getitem__`` that draws from the global RNGs or changes the
dataset's own attributes (counts, caches: workers would change copies), a dataset that holds a
random generator (each worker would copy it), and, under the spawn and forkserver start methods,
a ``__main__`` that does more than define and import at top level (each worker re-runs it) or a
dataset that does not pickle. Workers that fail anyway, or keep a batch past a bound, are shut down
and the batches they had not yielded are built in-process, as plain PyTorch builds them.
Also left alone: loaders whose script chose ``num_workers`` (the report recommends a number when the
step starves; ``--force loader_workers`` measures and raises it — a loader with workers of its own
is raised in place from its next epoch, so the script reads the raised number, which the reason
code says), DataLoader subclasses, and iterable datasets (each worker would replay the whole stream
unless it shards itself).
"""

from __future__ import annotations

import ast
import collections
import enum
import functools
import io
import itertools
import multiprocessing
import os
import random
import sys
import threading
import time
import weakref
from multiprocessing.reduction import ForkingPickler
from types import FunctionType

import psutil
import torch
import wrapt
from torch.utils.data import Dataset, IterableDataset, _utils, dataloader

from autogaudi import steps
from autogaudi.events import Event
from autogaudi.model_call import Layer, compiled_by_the_script
from autogaudi.steps import loader_arguments
from autogaudi.unit import RANDOM, ROUNDING, Unit

WARMUP_BATCHES = 2
MEASURED_BATCHES = 16
INPUT_BOUND = 0.5  # the share of each step spent waiting for data above which workers are tried
# A loader this starved after EARLY_BATCHES is tuned at once: the 10 batches more that a borderline
# loader is timed for would only cost it (the re-timed window still puts back workers that lose).
EARLY_BATCHES, CLEARLY_INPUT_BOUND = 6, 0.8
# Bounds on the waits workers add, in seconds: starting them (spawn and forkserver write the pickled
# dataset into a pipe that a child dying early never drains) and their first batch, start-up
# included; each later batch BATCH_BOUND_FACTOR times the in-process wait measured, at least
# BATCH_BOUND_S. Past a bound the batch is built in-process, as the plain run builds it.
START_BOUND_S = 60.0
BATCH_BOUND_S, BATCH_BOUND_FACTOR = 10.0, 100
SPAWNING = ("spawn", "forkserver")  # start methods whose workers are fresh interpreters


class Phase(enum.Enum):
    MEASURING = "measuring"  # in-process, timed
    NEXT_EPOCH = "next epoch"  # raised in place; the running epoch keeps the script's workers
    CHECKING = "checking"  # tuned, timed again
    DONE = "done"


def worker_budget():
    """(workers, main-process threads) for this machine and this process's share of it."""
    cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    per_rank = max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    workers = max(2, min(8, per_rank - 1))
    return workers, max(1, per_rank - workers)


def random_state() -> tuple:
    """Everything ``__getitem__`` could draw random numbers from in this process."""
    numpy = sys.modules.get("numpy")
    return (
        torch.random.get_rng_state(),
        random.getstate(),
        numpy.random.get_state()[1].tobytes() if numpy is not None else None,
    )


def _same(first: tuple, second: tuple) -> bool:
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


def why_not_workers(loader):
    """(reason code, values) why this loader's dataset must stay in-process, or None: checked before
    any worker starts."""
    kind = held_generator(loader.dataset)
    if kind is not None:
        return "holds_generator", {"kind": kind}
    method = start_method(loader)
    if method not in SPAWNING:
        return None
    main = reimported_main()
    if main is not None and not main_reruns_safely(main):
        return "main_reruns", {"method": method, "file": os.path.basename(main)}
    error = pickling_error((loader.dataset, loader.collate_fn, loader.worker_init_fn), main is not None)
    return ("not_picklable", {"method": method, "error": error}) if error is not None else None


class _Indices:
    """The epoch's own sampler iterator as the workers take from it: what they took and have not yet
    yielded is kept, in order, to go back to the in-process iterator if the workers are given up.
    Closed, it hands out nothing more (a start-up left running past its bound takes no batch)."""

    def __init__(self, sampler_iterator):
        self._source = sampler_iterator
        self.pending = collections.deque()
        self._closed = False
        self._lock = threading.Lock()

    def __iter__(self):
        return self

    def __next__(self):
        with self._lock:
            if self._closed:
                raise StopIteration
            index = next(self._source)
            self.pending.append(index)
            return index

    def close(self):
        """The rest of the epoch for the in-process iterator: the pending batches, then the sampler's."""
        with self._lock:
            self._closed = True
            return itertools.chain(list(self.pending), self._source)


class _RemainingIndices:
    """The index sampler of the rest of an epoch: iterating gives the epoch's own sampler iterator,
    already running, so the order is the one drawn when the epoch began."""

    def __init__(self, indices: _Indices, length: int):
        self._indices = indices
        self._length = length

    def __iter__(self):
        return self._indices

    def __len__(self):
        return self._length


class _WorkerLoader(wrapt.ObjectProxy):
    """The script's loader as the worker iterator sees it, the script's object left as it is: with
    workers, fed from the running epoch, in order, and without the script's ``timeout`` (the bounds
    are autogaudi's own, so no error of DataLoader's can come from them)."""

    timeout = 0
    in_order = True
    persistent_workers = False
    prefetch_factor = 2

    def __init__(self, loader, sampler: _RemainingIndices, workers: int, context):
        super().__init__(loader)
        self._self_sampler = sampler
        self._self_workers = workers
        self._self_context = context

    @property
    def _index_sampler(self):
        return self._self_sampler

    @property
    def num_workers(self):
        return self._self_workers

    @property
    def multiprocessing_context(self):
        return self._self_context

    @property
    def worker_init_fn(self):
        return functools.partial(_init_worker, self.__wrapped__.worker_init_fn)


class _Exited:
    """What a worker hands back for a batch whose ``__getitem__`` called ``sys.exit``: the main
    process exits there, as the plain run would, instead of building the item a second time."""

    def __init__(self, code):
        self.code = code


def _init_worker(init_fn, worker_id) -> None:
    """In a worker autogaudi added: ``sys.exit`` in the dataset comes back as :class:`_Exited`, and
    the worker builds nothing after it (the plain run would have stopped there)."""
    create = dataloader._DatasetKind.create_fetcher
    exited = []

    def create_fetcher(*args, **kwargs):
        fetcher = create(*args, **kwargs)
        fetch = fetcher.fetch

        def fetch_or_exit(index):
            if exited:
                return exited[0]
            try:
                return fetch(index)
            except SystemExit as exit:
                exited.append(_Exited(exit.code))
                return exited[0]

        fetcher.fetch = fetch_or_exit
        return fetcher

    dataloader._DatasetKind.create_fetcher = staticmethod(create_fetcher)
    if init_fn is not None:
        init_fn(worker_id)


class _TooSlow(Exception):
    pass


class _WorkerIterator(dataloader._MultiProcessingDataLoaderIter):
    """Workers building the rest of an epoch for the script's in-process iterator, which is routed
    here. Every wait for a batch is bounded; when the workers fail (die, raise, pass the bound) they
    are shut down, ``failed(error)`` is called, and the batches not yielded yet are built by the
    in-process iterator: a user's error in ``__getitem__`` then comes from there, as in the plain run."""

    def __init__(self, loader, in_process, indices: _Indices, batch_bound_s: float, failed):
        self._in_process = weakref.ref(in_process)  # routed from it: a strong reference would keep it alive
        self._indices = indices
        self._batch_bound_s = batch_bound_s
        self._failed = failed
        self._given = 0
        self.given_up = False
        super().__init__(loader)
        # A dead worker is found here, by polling, and the batch built in-process; torch's SIGCHLD
        # handler would raise its error wherever the script's own code happens to be running.
        _utils.signal_handling._remove_worker_pids(id(self))
        self._worker_pids_set = False

    def _get_data(self):
        bound = START_BOUND_S if self._given == 0 else self._batch_bound_s
        deadline = time.monotonic() + bound
        while (left := deadline - time.monotonic()) > 0:
            success, data = self._try_get_data(min(left, _utils.MP_STATUS_CHECK_INTERVAL))
            if success:
                return data
        raise _TooSlow(f"no batch from the workers within {bound:.0f} s")

    def _next_data(self):
        if not self.given_up:
            try:
                data = super()._next_data()
            except StopIteration:
                raise
            except Exception as error:
                self.give_up()
                self._failed(error)
            else:
                self._indices.pending.popleft()
                self._given += 1
                if isinstance(data, _Exited):  # the rest of the epoch in-process, should the script go on
                    self.give_up()
                    raise SystemExit(data.code)
                return data
        return self._in_process()._next_data()

    def give_up(self) -> None:
        """Shut the workers down and hand the rest of the epoch back to the in-process iterator."""
        if self.given_up:
            return
        self.given_up = True
        rest = self._indices.close()
        self._shutdown_workers()
        in_process = self._in_process()
        if in_process is not None:
            in_process._sampler_iter = rest

    def _shutdown_workers(self):
        if not hasattr(self, "_workers_status"):  # the start failed part way: stop what it started
            self._shutdown = True
            for worker in getattr(self, "_workers", ()):
                worker.terminate()
                worker.join(_utils.MP_STATUS_CHECK_INTERVAL)
            return
        super()._shutdown_workers()


def _bounded(build, method: str):
    """``build()``, given START_BOUND_S where the start method can block on a dead child (spawn and
    forkserver pickle into a pipe; fork cannot block, and builds where it is, keeping torch's
    SIGCHLD handler)."""
    if method not in SPAWNING:
        return build()
    outcome = {}

    def run():
        try:
            outcome["iterator"] = build()
        except BaseException as error:  # handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=run, name="autogaudi loader workers", daemon=True)
    thread.start()
    thread.join(START_BOUND_S)
    if thread.is_alive():
        raise _TooSlow(f"the workers did not start within {START_BOUND_S:.0f} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["iterator"]


def workers_for_rest_of_epoch(iterator, loader, workers: int, batch_bound_s: float, failed):
    """A worker-process iterator that yields the batches ``iterator`` (in-process, mid-epoch) has not
    yielded yet, in the same order; ``loader`` is not changed. Building it draws a base seed from
    the loader's generator (the global one by default); that draw is undone, so the script's random
    stream is not shifted. Where the workers cannot start, the in-process iterator keeps every batch
    and the error is raised."""
    method = start_method(loader)
    context = loader.multiprocessing_context or multiprocessing.get_context(method)  # the global one stays unset
    indices = _Indices(iterator._sampler_iter)
    remaining = _RemainingIndices(indices, len(loader._index_sampler))
    proxy = _WorkerLoader(loader, remaining, workers, context)
    global_state = torch.random.get_rng_state()
    generator_state = loader.generator.get_state() if loader.generator is not None else None
    try:
        return _bounded(lambda: _WorkerIterator(proxy, iterator, indices, batch_bound_s, failed), method)
    except BaseException:
        iterator._sampler_iter = indices.close()
        raise
    finally:
        torch.random.set_rng_state(global_state)
        if generator_state is not None:
            loader.generator.set_state(generator_state)


def set_attributes(scope, owner, **values) -> None:
    """Set attributes on a user's object; ``scope`` puts back each one that still holds what was set."""
    before = {name: getattr(owner, name) for name in values}
    for name, value in values.items():
        setattr(owner, name, value)
    owner = weakref.ref(owner)

    def undo():
        target = owner()
        for name, value in before.items():
            if target is not None and getattr(target, name) == values[name]:
                setattr(target, name, value)

    scope.add(undo)


class ThreadCut:
    """The main process's intra-op threads, cut while workers take cores, with the script still
    reading its own number: ``torch.get_num_threads()`` gives what it set (or started with), and a
    number it sets meanwhile becomes its own, the cut applied on top (the lower of the two)."""

    def __init__(self):
        self._holders: dict = {}  # holder -> threads it needs cut to
        self._script = None  # the script's number while cut

    def install(self, scope) -> None:
        scope.wrap(torch, "get_num_threads", self._get)
        scope.wrap(torch, "set_num_threads", self._set)

    def hold(self, holder, threads: int, scope) -> None:
        """Cut to ``threads`` until ``scope`` closes."""
        if not self._holders:
            self._script = torch._C.get_num_threads()
        self._holders[holder] = threads
        self._apply()
        scope.add(lambda: self._release(holder))

    def _release(self, holder) -> None:
        self._holders.pop(holder, None)
        if not self._holders and self._script is not None:
            torch._C.set_num_threads(self._script)
            self._script = None
        elif self._holders:
            self._apply()

    def _apply(self) -> None:
        torch._C.set_num_threads(min(self._script, *self._holders.values()))

    def script_threads(self) -> int:
        """The number of intra-op threads the script set (or started with), cut or not."""
        return self._script if self._holders else torch._C.get_num_threads()

    def _get(self, wrapped, instance, args, kwargs):
        return self._script if self._holders else wrapped(*args, **kwargs)

    def _set(self, wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)  # torch's own checks and errors, the script's number set
        if self._holders:
            self._script = torch._C.get_num_threads()
            self._apply()
        return result


class _Timing:
    """Waiting vs computing for one loader over a window of batches."""

    def __init__(self):
        self.batches = 0
        self.waited = 0.0
        self.computed = 0.0

    def add(self, waited: float, computed: float) -> None:
        self.batches += 1
        self.waited += waited
        self.computed += computed

    @property
    def input_bound(self) -> float:
        return self.waited / max(self.waited + self.computed, 1e-12)

    @property
    def ms_per_batch(self) -> float:
        return 1000 * (self.waited + self.computed) / max(self.batches, 1)


def measured_enough(timing: _Timing, phase: Phase) -> bool:
    """Whether a window has timed enough batches to decide on: all of them, except before tuning
    when waiting for data already dominates."""
    if phase is Phase.MEASURING and timing.batches >= EARLY_BATCHES and timing.input_bound >= CLEARLY_INPUT_BOUND:
        return True
    return timing.batches >= MEASURED_BATCHES


class _Loader:
    def __init__(self, loader):
        self.loader = weakref.ref(loader)  # the script owns the loader; this must not keep it alive
        # MEASURING -> [NEXT_EPOCH (raised in place, from its next epoch)] -> CHECKING -> DONE
        self.phase = Phase.MEASURING
        self.windows = {Phase.MEASURING: _Timing(), Phase.CHECKING: _Timing()}
        self.epoch_batches = 0
        self.last_end = None
        self.before = None  # (random state, dataset state) before a measured batch
        self.getitem_changes = None  # (reason code, values) once a measured __getitem__ changed state
        self.scope = None  # what tuning this loader changed, while tuned
        self.workers = 0


# A loader's own outcome and the unit's, where it differs (the unit's says "all")
_UNIT_REASON = {"not_starved": "none_starved", "no_faster": "workers_no_faster"}


class LoaderWorkers(Unit):
    # Workers draw from streams of their own, and the intra-op threads it cuts sum some CPU kernels in
    # another order (measured: a float32 sum of 2**20 values differs between 1 and 2 threads)
    numerics = (ROUNDING, RANDOM)
    exact_when = "the dataset draws no random numbers and the steps run no multi-threaded CPU reduction"
    reasons = {
        "measuring": "measuring each loader's first epoch",
        "none_starved": "measured: no loader starves the step, all kept in-process",
        "workers_no_faster": "measured: workers were tried and were no faster, all kept in-process",
        "workers": "{workers} workers for input-bound loaders (in-process ones: from the next batch)",
        "workers_raised": "{workers} workers for input-bound loaders; a loader whose script chose num_workers was "
        "raised in place (--force), and the script reads the raised number",
        "not_starved": "kept in-process: waiting for data is {share} of a step (workers are tried from {threshold})",
        "no_faster": "workers measured no faster ({after:.2f} vs {before:.2f} ms per batch, worker start-up "
        "included): put back in-process",
        "draws_global_random": "kept in-process: its __getitem__ draws from the global random generators, "
        "which worker processes would replace by their own",
        "mutates_state": "kept in-process: its __getitem__ changes the dataset's attribute {attribute!r}, which "
        "workers would change in their copies only",
        "holds_generator": "kept in-process: the dataset holds a random generator ({kind}), which each worker "
        "would copy and draw the same numbers from",
        "main_reruns": "kept in-process: under the {method} start method each worker re-runs {file}, which does "
        'more than define and import outside `if __name__ == "__main__":`',
        "not_picklable": "kept in-process: under the {method} start method workers get the dataset pickled, "
        "and that fails: {error}",
        "threads_cut": "while workers build the batches the main process computes with {threads} intra-op "
        "thread(s), not the script's {script}: CPU kernels that split a sum across threads add in another order "
        "(rounding: measured on the training model's next forward, where one is found)",
        "threads_cut_no_model": "the thread cut's rounding not measured: no training model found (the step profiler "
        "finds it) when the cut began",
        "threads_cut_script_compiles": "the thread cut's rounding not measured: the script compiles the training "
        "model, whose call it owns",
        "workers_failed": "workers failed ({error}); the loader went back in-process, its batches built there",
        "script_chose_workers": "a loader whose script chose num_workers is kept as is",
        "iterable_dataset": "iterable datasets are kept in-process: each worker would replay the whole stream",
        "forced_measured": "--force loader_workers: a loader whose script chose num_workers={chosen} is measured "
        "too; if raised, its workers' random streams differ from the plain run's (same distribution)",
        "shard_iterable": "the step waits for data {share:.0%} of the time and an IterableDataset feeds it "
        "in-process; workers would each replay the whole stream unless the dataset splits it by "
        "torch.utils.data.get_worker_info() (id, num_workers): if yours does, try num_workers={workers}",
        "more_workers": "the step waits for data {share:.0%} of the time and the script chose num_workers={chosen}; "
        "this machine has {cores} cores for {ranks} local rank(s): try num_workers={workers}, or --force "
        "loader_workers to have it measured and raised (worker random streams then differ from this run's, same "
        "distribution)",
    }
    changed_figure = ("loaders_tuned", "{} DataLoader(s) given worker processes")
    targets = ("torch.get_num_threads", "torch.set_num_threads")
    acts_on = ("DataLoader construction, epochs and batch fetches (the session's step watcher)",)

    def apply(self) -> None:
        self.figures.update(loaders_tuned=0, loaders_kept=0)
        self._loaders = weakref.WeakKeyDictionary()  # DataLoader -> _Loader, for loaders it may tune
        self._iterators = weakref.WeakKeyDictionary()  # iterator -> _Loader
        self._starting = None  # the _Loader whose next iterator is being created
        self._threads = ThreadCut()
        self._threads.install(self.scope)
        self.on(Event.LOADER_BUILT, self._consider)
        self.on(Event.EPOCH_START, self._new_epoch)
        self.on(Event.BEFORE_BATCH, self._before_batch)
        self.on(Event.BATCH_FETCHED, self._after_batch)
        self._script_workers: list = []  # num_workers of the loaders whose script chose it
        self._iterable_loaders = 0  # in-process loaders over an IterableDataset (never tuned)
        self.on(Event.STEP_PROFILED, self._advise)  # advice, where a step profiler runs
        self._measuring = None  # the scope of the layer that measures the cut, once
        self._cut_waiting = None  # the loader whose cut's measurement waits for the step profiler
        self._model = None  # the training model, weakly, once the step profiler found it
        self.on(Event.STEP_PROFILED, self._found_model)
        self.because("measuring")

    def numerics_in_run(self) -> tuple:
        # Workers that ran and were put back (no faster) ran their checked batches with the threads cut.
        return self.numerics_on(self.backend) if "workers" in self.figures else ()

    def watching(self) -> bool:
        # no loader yet, or one still being timed; not once every loader it saw is decided
        return not self._loaders or any(state.phase is not Phase.DONE for state in self._loaders.values())

    def _kept(self, code: str, **values) -> None:
        self.figures["loaders_kept"] += 1
        self.note(code, **values)

    def _keep(self, state, code: str, **values) -> None:
        """Keep a measured loader in-process (or put it back) for ``code``; the unit says so while no
        loader has workers."""
        state.phase = Phase.DONE
        self._kept(code, **values)
        kept = self.figures.setdefault("kept_because", {})
        kept[code] = kept.get(code, 0) + 1
        if not self.figures["loaders_tuned"]:
            if code in _UNIT_REASON:
                self.because(_UNIT_REASON[code])
            else:
                self.because(code, **values)

    def _consider(self, loader, args, kwargs):
        given = loader_arguments(loader, args, kwargs)
        if given is None:
            return None
        dataset, chosen = given.get("dataset"), given.get("num_workers")
        # --force loader_workers: a script's num_workers below the budget is measured and may be raised.
        raisable = (
            self.name in self.options.force
            and chosen is not None
            and chosen < worker_budget()[0]
            and not given.get("persistent_workers", False)  # their iterator, and its workers, are reused
            and not isinstance(dataset, IterableDataset)
        )
        if chosen is not None and not raisable:
            self._kept("script_chose_workers")
            self._script_workers.append(chosen)
        elif isinstance(dataset, IterableDataset):
            self._kept("iterable_dataset")
            self._iterable_loaders += 1
        else:
            self._loaders[loader] = _Loader(loader)
            if raisable:
                self.note("forced_measured", chosen=chosen)
        return None

    def _advise(self, profile) -> None:
        """A step that waits for data from a loader autogaudi may not tune: a script-chosen num_workers
        (worker random streams would differ) or an IterableDataset (only the dataset knows how to
        split its stream); what was measured and what to try is said."""
        if profile.bound != "input":
            return
        workers, _threads = worker_budget()
        share = profile.measured.input_wait_fraction
        if self._iterable_loaders:
            self.recommend(
                "shard_iterable",
                share=share,
                workers=workers,
                do=f"num_workers={workers} with a dataset that splits its stream by get_worker_info()",
                saves=share,
                saves_basis="measured",
            )
        if not self._script_workers:
            return
        chosen = max(self._script_workers)
        if chosen >= workers:
            return
        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.recommend(
            "more_workers",
            share=share,
            chosen=chosen,
            cores=cores,
            ranks=ranks,
            workers=workers,
            do=f"num_workers={workers} instead of the script's {chosen} (or --force loader_workers)",
            saves=share,
            saves_basis="measured",
        )

    def _new_epoch(self, loader) -> None:
        state = self._loaders.get(loader)
        if state is not None:
            # Checking a tuned loader counts from the moment its workers are started, so their
            # start-up (a fresh interpreter each under spawn) weighs against them.
            state.epoch_batches = 0
            if state.phase is Phase.NEXT_EPOCH:
                state.phase = Phase.CHECKING
            state.last_end = steps.clock() if state.phase is Phase.CHECKING else None
        self._starting = state

    def _state(self, iterator):
        state = self._iterators.get(iterator)
        if state is None and self._starting is not None:
            state = self._iterators[iterator] = self._starting
            self._starting = None
        return state

    def _before_batch(self, iterator) -> None:
        state = self._state(iterator)
        if state is not None and state.phase is Phase.MEASURING and state.epoch_batches >= WARMUP_BATCHES:
            state.before = (random_state(), instance_state(iterator._dataset))

    def _after_batch(self, iterator, _batch, waited: float) -> None:
        state = self._state(iterator)
        if state is None:
            return
        now = steps.clock()
        timed = state.phase in (Phase.MEASURING, Phase.CHECKING)
        if timed:
            window = state.windows[state.phase]
            # Before tuning, the first batches of an epoch are not measured: the sampler draws its seed
            # there and the time since the previous epoch's last batch is not a training step.
            if state.last_end is not None and (state.phase is Phase.CHECKING or state.epoch_batches >= WARMUP_BATCHES):
                window.add(waited, now - waited - state.last_end)
                if state.phase is Phase.MEASURING:
                    self._check_getitem(state, iterator._dataset)
            state.last_end = now
        state.epoch_batches += 1
        if timed and measured_enough(window, state.phase):
            self._decide(state, iterator)
        if state.epoch_batches == 1 and state.scope is not None and _in_process(iterator):
            # a tuned loader's later epoch: its first batch was built here, the rest by workers
            self._start_workers(state, iterator, state.loader())

    def _check_getitem(self, state, dataset) -> None:
        """Whether the measured batch's ``__getitem__`` changed what workers would not give back:
        the global random streams (workers draw from their own) or the dataset's own attributes."""
        if state.before is None or state.getitem_changes is not None:
            return
        random_before, dataset_before = state.before
        attribute = changed_attribute(dataset_before, instance_state(dataset))
        if not _same(random_before, random_state()):
            state.getitem_changes = ("draws_global_random", {})
        elif attribute is not None:
            state.getitem_changes = ("mutates_state", {"attribute": attribute})

    def _decide(self, state, iterator) -> None:
        loader = state.loader()
        before, after = state.windows[Phase.MEASURING], state.windows[Phase.CHECKING]
        if state.phase is Phase.MEASURING:
            state.phase = Phase.DONE
            self.figures["input_bound_fraction"] = round(before.input_bound, 3)
            self.figures["ms_per_batch_before"] = round(before.ms_per_batch, 3)
            if state.getitem_changes is not None:
                self._keep(state, state.getitem_changes[0], **state.getitem_changes[1])
            elif before.input_bound < INPUT_BOUND:
                self._keep(state, "not_starved", share=f"{before.input_bound:.0%}", threshold=f"{INPUT_BOUND:.0%}")
            elif loader is None:
                return
            elif (why := why_not_workers(loader)) is not None:  # checked before any worker starts
                self._keep(state, why[0], **why[1])
            else:
                self._tune(loader, state, iterator)
        else:
            state.phase = Phase.DONE
            self.figures["ms_per_batch_after"] = round(after.ms_per_batch, 3)
            if after.ms_per_batch >= before.ms_per_batch:
                self._untune(state)
                self._keep(state, "no_faster", after=after.ms_per_batch, before=before.ms_per_batch)

    def _tune(self, loader, state, iterator) -> None:
        workers, threads = worker_budget()
        measured = state.windows[Phase.MEASURING]
        state.workers = workers
        state.bound_s = max(BATCH_BOUND_S, BATCH_BOUND_FACTOR * measured.waited / max(measured.batches, 1))
        state.scope = self.scope.child()
        state.sources = weakref.WeakSet()  # the worker iterators of its epochs
        state.scope.add(lambda: _give_up(state.sources))
        script_threads = self._threads.script_threads()
        self._threads.hold(state, threads, state.scope)
        if torch._C.get_num_threads() < script_threads:
            self.note("threads_cut", threads=torch._C.get_num_threads(), script=script_threads)
            self._measure_cut(state)
        self.figures.update(
            loaders_tuned=self.figures["loaders_tuned"] + 1, workers=workers, main_threads=torch._C.get_num_threads()
        )
        self.moment("workers", workers=workers)
        # timed on from the last measured batch, or from the next epoch's start: the workers' start-up
        # counts against them
        if _in_process(iterator):
            state.phase = Phase.CHECKING
            self.because("workers", workers=workers)
            if self._start_workers(state, iterator, loader):
                self.figures["workers_from_batch"] = state.epoch_batches + 1
        else:  # the script's own workers: raised in place, from the next epoch
            set_attributes(state.scope, loader, num_workers=workers, prefetch_factor=loader.prefetch_factor or 2)
            state.phase = Phase.NEXT_EPOCH
            self.because("workers_raised", workers=workers)

    def _found_model(self, profile) -> None:
        if profile.model is not None:
            self._model = weakref.ref(profile.model)
        waiting, self._cut_waiting = self._cut_waiting, None
        if waiting is not None and waiting.scope is not None:  # its cut still on
            self._measure_cut(waiting)

    def _measure_cut(self, state) -> None:
        """The thread cut's rounding, once, where it first applies: on the training model's next
        training call, its output with the cut thread count against the script's, both on a copy
        from the same generator state (:func:`autogaudi.numerics.forward_difference`)."""
        if "numerics_measured" in self.figures or self._measuring is not None:
            return
        model = self._model() if self._model is not None else None
        if model is None and self._model is None and self.session.unit("step_profiler") is not None:
            self._cut_waiting = state  # the step profiler has not named the model yet
            return
        if model is None:
            self.note("threads_cut_no_model")
            return
        if compiled_by_the_script(model):
            self.note("threads_cut_script_compiles")
            return
        self._measuring = state.scope.child()
        self.hold(model, Layer.MEASURE, functools.partial(self._measured_call, model), self._measuring)

    def _measured_call(self, model, call, args, kwargs):
        if not (model.training and torch.is_grad_enabled()):
            return call(*args, **kwargs)
        self.close_scope(self._measuring)
        cut, script = torch._C.get_num_threads(), self._threads.script_threads()
        self.measure_numerics(
            model,
            args,
            kwargs,
            of="outputs",
            against=f"the script's {script} intra-op threads, on a copy",
            around=_with_threads(cut),
            reference=_with_threads(script),
        )
        return call(*args, **kwargs)

    def _start_workers(self, state, iterator, loader) -> bool:
        """Route the rest of the epoch of ``iterator`` to workers; False where they did not start (the
        loader goes back in-process, the epoch goes on there with every batch)."""

        def failed(error):
            with self.fail_open():
                self._workers_failed(state, error)

        try:
            source = workers_for_rest_of_epoch(iterator, loader, state.workers, state.bound_s, failed)
        except Exception as error:
            self._workers_failed(state, error)
            return False
        state.sources.add(source)
        self.session.steps.route_batches(iterator, source)
        return True

    def _workers_failed(self, state, error) -> None:
        if state.scope is None:
            return
        self._untune(state)
        first_line = str(error).strip().splitlines()[:1]
        self._keep(state, "workers_failed", error=": ".join([type(error).__name__, *first_line]))

    def _untune(self, state) -> None:
        """Put the loader back in-process: its workers, routes and thread cut undone."""
        if state.scope is None:
            return
        scope, state.scope = state.scope, None
        self.close_scope(scope)
        self.moment("in_process")
        self.figures["loaders_tuned"] -= 1
        self.figures["main_threads"] = torch._C.get_num_threads()


def _with_threads(threads: int):
    """A copy's forward with ``threads`` intra-op threads (torch's own setter: the script's is wrapped)."""

    def forward(shadow, args, kwargs):
        before = torch._C.get_num_threads()
        torch._C.set_num_threads(threads)
        try:
            return shadow(*args, **kwargs)
        finally:
            torch._C.set_num_threads(before)

    return forward


def _give_up(sources) -> None:
    """Hand each worker iterator's epoch back in-process (an undo: it returns no note)."""
    for source in list(sources):
        source.give_up()


def _in_process(iterator) -> bool:
    return type(iterator) is dataloader._SingleProcessDataLoaderIter
