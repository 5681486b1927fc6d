"""The worker-process iterator that takes over the rest of an epoch from the script's in-process
iterator, fed from that epoch's own sampler iterator, every wait bounded, and handing what it has not
yielded back in-process when the workers fail."""

from __future__ import annotations

import collections
import functools
import itertools
import multiprocessing
import threading
import time
import weakref

import torch
import wrapt
from torch.utils.data import _utils, dataloader

from autogaudi.optimizations.loader_workers.safety import SPAWNING, start_method

# The bound, in seconds, on starting the workers (spawn and forkserver write the pickled dataset into
# a pipe that a child dying early never drains) and on their first batch, start-up included; later
# batches get the bound the unit gives. Past a bound the batch is built in-process, as the plain run
# builds it.
START_BOUND_S = 60.0


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

    def _reset(self, loader, first_iter=False):
        # A dead worker is found by polling, and its batches built in-process. torch's SIGCHLD handler
        # would raise wherever the main thread is: inside an index queue's put (the prefetch below)
        # that leaves the queue's lock held, and the shutdown's own put then never returns.
        if self._worker_pids_set:
            _utils.signal_handling._remove_worker_pids(id(self))
            self._worker_pids_set = False
        super()._reset(loader, first_iter)

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


def give_up_all(sources) -> None:
    """Hand each worker iterator's epoch back in-process (an undo: it returns no note)."""
    for source in list(sources):
        source.give_up()


def in_process(iterator) -> bool:
    """Whether ``iterator`` is a loader's in-process one (``num_workers=0``)."""
    return type(iterator) is dataloader._SingleProcessDataLoaderIter


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
