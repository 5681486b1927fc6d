"""DataLoader worker processes, switched on only for a loader measured to starve the training step.

Why: with ``num_workers=0`` (the default) the training loop itself builds every batch, so the
device (or the compute threads) idle while ``__getitem__`` runs. Workers build batches in parallel.
But workers also cost: on a 2-core machine one worker was measured slower than none, and a compute-
bound step loses from the cores the workers take. So nothing is assumed: during the first epoch,
after two warm-up batches, autogaudi times 16 batches (6 when waiting already holds 80%) — time
waiting for the batch vs time between batches — and only when waiting is at least half of it does it
tune that loader, in place, at once:
``num_workers`` from the machine (physical cores per local rank, less one for the main process, at
least 2), ``prefetch_factor=2``, and the main process's intra-op threads cut to the cores the
workers leave free. The epoch being measured goes on with workers from its next batch
(:func:`workers_for_rest_of_epoch`): one long epoch, a one-epoch run and an endless sampler
(minGPT's, makemore's) gain from the first minutes, not from an epoch 2 they may never reach. The
next 16 batches are timed again, worker start-up included; if they did not come faster the loader
is put back from its next epoch (the running one finishes with its workers) and the report says so.

Faithfulness: batches and their order are the same (the sampler still runs in the main process;
mid-epoch, the workers are fed from the epoch's own sampler iterator, and the seed the new iterator
draws is undone, so the random stream is the plain run's).
Workers are not persistent on purpose: a DataLoader draws one seed from the global RNG per epoch
either way, while persistent workers would skip those draws from epoch 2 on and shift dropout and
shuffling (measured: 3e-2 loss drift). A dataset whose ``__getitem__`` draws from the global RNGs
(torch, random, numpy) — detected while measuring — is left alone: in workers those draws come from
per-worker generators (as PyTorch defines it), which would change the numbers. Also left alone:
loaders whose script chose ``num_workers`` (the report recommends a number when the step starves;
``--force loader_workers`` measures and raises it, from the next epoch, keeping it only if faster:
with another worker count each worker's random stream differs from the plain run's, same
distribution), DataLoader subclasses, and iterable datasets (each worker would replay the whole
stream unless it shards itself).
"""

from __future__ import annotations

import os
import random
import sys
import time
import weakref

import psutil
import torch
import wrapt
from torch.utils.data import IterableDataset, dataloader

from autogaudi.events import Event
from autogaudi.steps import loader_arguments
from autogaudi.unit import Unit

WARMUP_BATCHES = 2
MEASURED_BATCHES = 16
INPUT_BOUND = 0.5  # the share of each step spent waiting for data above which workers are tried
# A loader this starved after EARLY_BATCHES is tuned at once: the 10 batches more that a borderline
# loader is timed for would only cost it (the re-timed window still puts back workers that lose).
EARLY_BATCHES, CLEARLY_INPUT_BOUND = 6, 0.8


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


class _RemainingIndices:
    """What an epoch has not yielded yet: iterating gives the epoch's own sampler iterator, already
    running, so the order is the one drawn when the epoch began."""

    def __init__(self, sampler_iterator, length: int):
        self._iterator = sampler_iterator
        self._length = length

    def __iter__(self):
        return self._iterator

    def __len__(self):
        return self._length


class _ResumingLoader(wrapt.ObjectProxy):
    """The loader as a worker iterator built mid-epoch sees it: itself, but for its index sampler."""

    def __init__(self, loader, remaining: _RemainingIndices):
        super().__init__(loader)
        self._self_remaining = remaining

    @property
    def _index_sampler(self):
        return self._self_remaining


def workers_for_rest_of_epoch(iterator, loader):
    """A worker-process iterator that yields the batches ``iterator`` (in-process, mid-epoch) has not
    yielded yet, in the same order. Building it draws a base seed from the loader's generator (the
    global one by default); that draw is undone, so the script's random stream is not shifted."""
    remaining = _RemainingIndices(iterator._sampler_iter, len(loader._index_sampler))
    global_state = torch.random.get_rng_state()
    generator_state = loader.generator.get_state() if loader.generator is not None else None
    try:
        return dataloader._MultiProcessingDataLoaderIter(_ResumingLoader(loader, remaining))
    finally:
        torch.random.set_rng_state(global_state)
        if generator_state is not None:
            loader.generator.set_state(generator_state)


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


def measured_enough(timing: _Timing, phase: str) -> bool:
    """Whether a window has timed enough batches to decide on: all of them, except before tuning
    when waiting for data already dominates."""
    if phase == "before" and timing.batches >= EARLY_BATCHES and timing.input_bound >= CLEARLY_INPUT_BOUND:
        return True
    return timing.batches >= MEASURED_BATCHES


class _Loader:
    def __init__(self, loader):
        self.loader = weakref.ref(loader)  # the script owns the loader; this must not keep it alive
        # before -> [next epoch (tuned, its workers start with the next epoch)] -> after (tuned, being
        # checked) -> done
        self.phase = "before"
        self.windows = {"before": _Timing(), "after": _Timing()}
        self.epoch_batches = 0
        self.last_end = None
        self.random_before = None
        self.draws_randomness = False
        self.original = None


class LoaderWorkers(Unit):
    reasons = {
        "measuring": "measuring each loader's first epoch",
        "none_starved": "measured: no loader starves the step, all kept in-process",
        "workers_no_faster": "measured: workers were tried and were no faster, all kept in-process",
        "workers": "{workers} workers for input-bound loaders (in-process ones: from the next batch)",
    }
    changed_figure = ("loaders_tuned", "{} DataLoader(s) given worker processes")
    acts_on = ("DataLoader construction, epochs and batch fetches (the session's step watcher)",)

    def apply(self) -> None:
        self.figures.update(loaders_tuned=0, loaders_kept=0)
        self._loaders = weakref.WeakKeyDictionary()  # DataLoader -> _Loader, for loaders it may tune
        self._iterators = weakref.WeakKeyDictionary()  # iterator -> _Loader
        self._starting = None  # the _Loader whose next iterator is being created
        self._threads_before = None
        self.on(Event.LOADER_BUILT, self._consider)
        self.on(Event.EPOCH_START, self._new_epoch)
        self.on(Event.BEFORE_BATCH, self._before_batch)
        self.on(Event.BATCH_FETCHED, self._after_batch)
        self.on_revert(self._untune_all)
        self._script_workers: list = []  # num_workers of the loaders whose script chose it
        self._iterable_loaders = 0  # in-process loaders over an IterableDataset (never tuned)
        self.on(Event.STEP_PROFILED, self._advise)  # advice, where a step profiler runs
        self.because("measuring")

    def watching(self) -> bool:
        # no loader yet, or one still being timed; not once every loader it saw is decided
        return not self._loaders or any(state.phase != "done" for state in self._loaders.values())

    def _kept(self, why: str) -> None:
        self.figures["loaders_kept"] += 1
        self.note(why)

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
            self._kept("a loader whose script chose num_workers is kept as is")
            self._script_workers.append(chosen)
        elif isinstance(dataset, IterableDataset):
            self._kept("iterable datasets are kept in-process: each worker would replay the whole stream")
            self._iterable_loaders += 1
        else:
            self._loaders[loader] = _Loader(loader)
            if raisable:
                self.note(
                    f"--force loader_workers: a loader whose script chose num_workers={chosen} is measured too; "
                    "if raised, its workers' random streams differ from the plain run's (same distribution)"
                )
        return None

    def _advise(self, profile) -> None:
        """A step that waits for data from a loader autogaudi may not tune: a script-chosen num_workers
        (worker random streams would differ) or an IterableDataset (only the dataset knows how to
        split its stream); what was measured and what to try is said."""
        if profile.bound != "input":
            return
        workers, _threads = worker_budget()
        if self._iterable_loaders:
            self.recommend(
                f"the step waits for data {profile.figures['input_wait_fraction']:.0%} of the time and an "
                "IterableDataset feeds it in-process; workers would each replay the whole stream unless the "
                "dataset splits it by torch.utils.data.get_worker_info() (id, num_workers): if yours does, "
                f"try num_workers={workers}"
            )
        if not self._script_workers:
            return
        chosen = max(self._script_workers)
        if chosen >= workers:
            return
        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.recommend(
            f"the step waits for data {profile.figures['input_wait_fraction']:.0%} of the time and the script "
            f"chose num_workers={chosen}; this machine has {cores} cores for {ranks} local rank(s): "
            f"try num_workers={workers}, or --force loader_workers to have it measured and raised "
            "(worker random streams then differ from this run's, same distribution)"
        )

    def _new_epoch(self, loader) -> None:
        state = self._loaders.get(loader)
        if state is not None:
            # Checking a tuned loader counts from the moment its workers are started, so their
            # start-up (a fresh interpreter each under spawn) weighs against them.
            state.epoch_batches = 0
            if state.phase == "next epoch":
                state.phase = "after"
            state.last_end = time.perf_counter() if state.phase == "after" else None
        self._starting = state

    def _state(self, iterator):
        state = self._iterators.get(iterator)
        if state is None and self._starting is not None:
            state = self._iterators[iterator] = self._starting
            self._starting = None
        return state if state is not None and state.phase != "done" else None

    def _before_batch(self, iterator) -> None:
        state = self._state(iterator)
        if state is not None and state.phase == "before":
            state.random_before = random_state()

    def _after_batch(self, iterator, _batch, waited: float) -> None:
        state = self._state(iterator)
        if state is None or state.phase == "next epoch":  # the rest of this epoch has the old workers
            return
        now = time.perf_counter()
        window = state.windows[state.phase]
        # Before tuning, the first batches of an epoch are not measured: the sampler draws its seed
        # there and the time since the previous epoch's last batch is not a training step.
        if state.last_end is not None and (state.phase == "after" or state.epoch_batches >= WARMUP_BATCHES):
            window.add(waited, now - waited - state.last_end)
            if state.phase == "before" and not _same(state.random_before, random_state()):
                state.draws_randomness = True
        state.last_end = now
        state.epoch_batches += 1
        if measured_enough(window, state.phase):
            self._decide(state, iterator)

    def _decide(self, state, iterator) -> None:
        loader = state.loader()
        before, after = state.windows["before"], state.windows["after"]
        if state.phase == "before":
            state.phase = "done"
            self.figures["input_bound_fraction"] = round(before.input_bound, 3)
            self.figures["ms_per_batch_before"] = round(before.ms_per_batch, 3)
            if state.draws_randomness:
                self._kept(
                    "kept in-process: its __getitem__ draws from the global random generators, "
                    "which worker processes would replace by their own"
                )
            elif before.input_bound < INPUT_BOUND:
                self._kept(
                    f"kept in-process: waiting for data is {before.input_bound:.0%} of a step "
                    f"(workers are tried from {INPUT_BOUND:.0%})"
                )
            elif loader is not None:
                self._tune(loader, state, iterator)
            if not self.figures["loaders_tuned"]:
                self.because("none_starved")
        else:
            state.phase = "done"
            self.figures["ms_per_batch_after"] = round(after.ms_per_batch, 3)
            if after.ms_per_batch >= before.ms_per_batch and loader is not None:
                self._untune(loader, state)
                self.figures["loaders_tuned"] -= 1
                self.figures["main_threads"] = torch.get_num_threads()
                self._kept(
                    f"workers measured no faster ({after.ms_per_batch:.2f} vs "
                    f"{before.ms_per_batch:.2f} ms per batch, worker start-up included): "
                    f"put back to num_workers=0"
                )
                if not self.figures["loaders_tuned"]:
                    self.because("workers_no_faster")

    def _tune(self, loader, state, iterator) -> None:
        workers, threads = worker_budget()
        state.original = (loader.num_workers, loader.prefetch_factor)
        loader.num_workers, loader.prefetch_factor = workers, loader.prefetch_factor or 2
        if self._threads_before is None:
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(min(threads, self._threads_before))
        # timed on from the last measured batch, or from the next epoch's start: the workers' start-up
        # counts against them
        state.phase = "next epoch"
        if type(iterator) is dataloader._SingleProcessDataLoaderIter:
            self.session.steps.route_batches(iterator, workers_for_rest_of_epoch(iterator, loader))
            self.figures["workers_from_batch"] = state.epoch_batches + 1
            state.phase = "after"
        self.figures.update(
            loaders_tuned=self.figures["loaders_tuned"] + 1, workers=workers, main_threads=torch.get_num_threads()
        )
        self.because("workers", workers=workers)

    def _untune(self, loader, state) -> None:
        if state.original is not None:
            loader.num_workers, loader.prefetch_factor = state.original
            state.original = None
        if self._threads_before is not None and not any(s.original for s in self._loaders.values()):
            torch.set_num_threads(self._threads_before)
            self._threads_before = None

    def _untune_all(self) -> None:
        for loader, state in list(self._loaders.items()):
            self._untune(loader, state)
