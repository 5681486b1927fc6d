"""DataLoader worker processes, switched on only for a loader measured to starve the training step,
and only where workers give the batches, the numbers and the state the plain run has.

Why: with ``num_workers=0`` the training loop builds every batch while the device waits; workers
build them in parallel, but take cores a compute-bound step needs (one worker was measured slower
than none on a 2-core machine). So each loader's first epoch is timed (waiting for the batch against
the time between batches), only a starving one is tuned, and it is timed again: one that did not
come faster goes back in-process. The loader object is not changed: the rest of its epoch comes from
a worker iterator fed by that epoch's own sampler (:mod:`.worker_iterator`), so the batches, their
order and the random stream are the plain run's. Datasets whose results workers would change stay
in-process, each with its reason code (:mod:`.safety`). docs/units/loader_workers.md has the rules.
"""

from __future__ import annotations

import functools
import os
import weakref

import torch
from torch.utils.data import IterableDataset

from autogaudi.core.candidate import State
from autogaudi.core.events import Event
from autogaudi.core.unit import RANDOM, ROUNDING, Unit, UnitSpec
from autogaudi.entry.ranks import several_ranks
from autogaudi.measure import machine_load, trials
from autogaudi.optimizations.loader_workers.loader_state import LoaderState, Timing, period_noise_ms
from autogaudi.optimizations.loader_workers.thread_cut import ThreadCut, with_threads, worker_budget
from autogaudi.watch import steps
from autogaudi.watch.model_call import Layer, compiled_by_the_script
from autogaudi.watch.steps import loader_arguments

WARMUP_BATCHES = 2
MEASURED_BATCHES = 16
INPUT_BOUND = 0.5  # the share of each step spent waiting for data above which workers are tried
# A loader this starved after EARLY_BATCHES is tuned at once: the 10 batches more that a borderline
# loader is timed for would only cost it (the re-timed window still puts back workers that lose).
EARLY_BATCHES, CLEARLY_INPUT_BOUND = 6, 0.8
# Bounds on each batch workers build after their first (whose bound, start-up included, is
# worker_iterator.START_BOUND_S): BATCH_BOUND_FACTOR times the in-process wait measured, at least
# BATCH_BOUND_S. Past a bound the batch is built in-process, as the plain run builds it.
BATCH_BOUND_S, BATCH_BOUND_FACTOR = 10.0, 100


def measured_enough(timing: Timing, lifecycle: State) -> bool:
    """Whether a window has timed enough batches to decide on: all of them, except before tuning
    when waiting for data already dominates."""
    if lifecycle is State.WAITING and timing.batches >= EARLY_BATCHES and timing.input_bound >= CLEARLY_INPUT_BOUND:
        return True
    return timing.batches >= MEASURED_BATCHES


def workers_faster(before: Timing, after: Timing, materiality: float, workers: int = 1) -> bool:
    """Whether the batches came faster with ``workers`` workers (their start-up included) than
    in-process, by the runner's one rule (:func:`autogaudi.measure.trials.decide`) on rounds of one batch per
    worker: its margin on the medians, beyond the two windows' spread, and, since workers change the
    numbers (their random streams, the thread cut's rounding), by ``materiality`` of the in-process
    batch's period."""
    return trials.decide(after.rounds(workers), before.rounds(workers), materiality=materiality).keep


# A loader's own outcome and the unit's, where it differs (the unit's says "all")
_UNIT_REASON = {"not_starved": "none_starved", "no_faster": "workers_no_faster"}


class LoaderWorkers(Unit):
    spec = UnitSpec(
        # Workers draw from streams of their own, and the intra-op threads it cuts sum some CPU kernels in
        # another order (measured: a float32 sum of 2**20 values differs between 1 and 2 threads)
        numerics=(ROUNDING, RANDOM),
        exact_when="the dataset draws no random numbers and the steps run no multi-threaded CPU reduction",
        reasons={
            "measuring": "measuring each loader's first epoch",
            "none_starved": "measured: no loader starves the step, all kept in-process",
            "workers_no_faster": "measured: workers were tried and were no faster, all kept in-process",
            "workers": "{workers} workers for input-bound loaders (in-process ones: from the next batch)",
            "workers_raised": "{workers} workers for input-bound loaders; a loader whose script chose num_workers was "
            "raised in place (--force), and the script reads the raised number",
            "not_starved": "kept in-process: waiting for data is {share} of a step (workers are tried from "
            "{threshold})",
            "no_faster": "workers measured no faster ({after:.2f} vs {before:.2f} ms per batch, worker start-up "
            "included): put back in-process",
            "draws_global_random": "kept in-process: its __getitem__ draws from the global random generators, "
            "which worker processes would replace by their own",
            "mutates_state": "kept in-process: its __getitem__ changes the dataset's attribute {attribute!r}, which "
            "workers would change in their copies only",
            "holds_generator": "kept in-process: the dataset holds a random generator ({kind}), which each worker "
            "would copy and draw the same numbers from",
            "rounds_otherwise": "kept in-process: its __getitem__ builds other numbers with one intra-op thread, "
            "as each worker runs, than with the script's {threads} (a sum split across threads adds in another order)",
            "main_reruns": "kept in-process: under the {method} start method each worker re-runs {file}, which does "
            'more than define and import outside `if __name__ == "__main__":`',
            "not_picklable": "kept in-process: under the {method} start method workers get the dataset pickled, "
            "and that fails: {error}",
            "threads_cut": "while workers build the batches the main process computes with {threads} intra-op "
            "thread(s), not the script's {script}: measured to leave the training model's outputs bit for bit as "
            "they were (CPU kernels that split a sum across threads can add in another order elsewhere)",
            "threads_kept_rounding": "the main process keeps the script's {script} intra-op threads beside the "
            "workers: {threads} changed the training model's outputs (rounding), and no timing may choose that",
            "threads_kept_no_model": "the main process keeps the script's {script} intra-op threads beside the "
            "workers: no training model found (the step profiler finds it) to show that fewer change no output",
            "threads_kept_not_measured": "the main process keeps the script's {script} intra-op threads beside "
            "the workers: whether {threads} change the training model's outputs could not be measured",
            "threads_kept_script_compiles": "the main process keeps the script's {script} intra-op threads beside "
            "the workers: the script compiles the training model, whose call it owns, so fewer threads' rounding "
            "cannot be measured",
            "workers_failed": "workers failed ({error}); the loader went back in-process, its batches built there",
            "script_chose_workers": "a loader whose script chose num_workers is kept as is",
            "iterable_dataset": "iterable datasets are kept in-process: each worker would replay the whole stream",
            "forced_measured": "--force loader_workers: a loader whose script chose num_workers={chosen} is measured "
            "too; if raised, its workers' random streams differ from the plain run's (same distribution)",
            "shard_iterable": "the step waits for data {share:.0%} of the time and an IterableDataset feeds it "
            "in-process; workers would each replay the whole stream unless the dataset splits it by "
            "torch.utils.data.get_worker_info() (id, num_workers): if yours does, try num_workers={workers}",
            "more_workers": "the step waits for data {share:.0%} of the time and the script chose "
            "num_workers={chosen}; "
            "this machine has {cores} cores for {ranks} local rank(s): try num_workers={workers}, or --force "
            "loader_workers to have it measured and raised (worker random streams then differ from this run's, same "
            "distribution)",
        },
        changed_figure=("loaders_tuned", "{} DataLoader(s) given worker processes"),
        targets=("torch.get_num_threads", "torch.set_num_threads"),
        acts_on=("DataLoader construction, epochs and batch fetches (the session's step watcher)",),
    )

    def apply(self) -> None:
        self.report.figures.update(loaders_tuned=0, loaders_kept=0)
        self._tuned = 0  # loaders with workers now
        self._ever_cut = False  # the threads were cut while workers ran (their steps' rounding)
        self._ever_raised = False  # a script's own workers were raised (their random streams)
        self._loaders = weakref.WeakKeyDictionary()  # DataLoader -> LoaderState, for loaders it may tune
        self._decided = False  # a loader's window was decided (its state goes with the loader)
        self._iterators = weakref.WeakKeyDictionary()  # iterator -> LoaderState
        self._starting = None  # the LoaderState whose next iterator is being created
        self._threads = ThreadCut()
        self._threads.install(self.scope)
        self.scope.on(Event.LOADER_BUILT, self._consider)
        self.scope.on(Event.EPOCH_START, self._new_epoch)
        self.scope.on(Event.BEFORE_BATCH, self._before_batch)
        self.scope.on(Event.BATCH_FETCHED, self._after_batch)
        self._script_workers: list = []  # num_workers of the loaders whose script chose it
        self._iterable_loaders = 0  # in-process loaders over an IterableDataset (never tuned)
        self.scope.on(Event.STEP_PROFILED, self._advise)  # advice, where a step profiler runs
        self._measuring = None  # the scope of the layer that measures the cut, once
        self._cut_measured = None  # whether the cut left the outputs as they were (None: not measured yet)
        self._cut_waiting: list = []  # the tuned loaders whose cut waits for its measurement
        self._model = None  # the training model, weakly, once the step profiler found it
        self.scope.on(Event.STEP_PROFILED, self._found_model)
        self.report.because("no_loader")

    def numerics_in_run(self) -> tuple:
        # Workers that ran and were put back (no faster) ran their checked batches with the threads cut.
        return ((ROUNDING,) if self._ever_cut else ()) + ((RANDOM,) if self._ever_raised else ())

    def _kept(self, code: str, **values) -> None:
        self.report.figures["loaders_kept"] += 1
        self.report.note(code, **values)

    def _keep(self, state, code: str, **values) -> None:
        """Keep a measured loader in-process (or put it back) for ``code``; the unit says so while no
        loader has workers."""
        state.lifecycle = State.REFUSED if state.lifecycle is State.WAITING else State.RELEASED
        self._kept(code, **values)
        kept = self.report.figures.setdefault("kept_because", {})
        kept[code] = kept.get(code, 0) + 1
        if not self._tuned:
            if code in _UNIT_REASON:
                self.report.because(_UNIT_REASON[code])
            else:
                self.report.because(code, **values)

    def _consider(self, loader, args, kwargs):
        given = loader_arguments(loader, args, kwargs)
        if given is None:
            return None
        dataset, chosen = given.get("dataset"), given.get("num_workers")
        # --force loader_workers: a script's num_workers below the budget is measured and may be raised.
        raisable = (
            self.name in self.run.options.force
            and chosen is not None
            and chosen < worker_budget()[0]
            and not given.get("persistent_workers", False)  # their iterator, and its workers, are reused
            and not isinstance(dataset, IterableDataset)
        )
        if chosen is not None and not raisable:
            self._kept_as_built("script_chose_workers")
            self._script_workers.append(chosen)
        elif isinstance(dataset, IterableDataset):
            self._kept_as_built("iterable_dataset")
            self._iterable_loaders += 1
        else:
            state = self._loaders[loader] = LoaderState(loader)
            self.run.trials.measuring(self, state)
            if not self._tuned:
                self.report.because("measuring")
            if raisable:
                self.report.note("forced_measured", chosen=chosen)
        return None

    def _kept_as_built(self, code: str) -> None:
        """A loader it may not tune; the unit's reason says so while no loader was measured."""
        self._kept(code)
        if not (self._loaders or self._decided):
            self.report.because(code)

    def _advise(self, profile) -> None:
        """A step that waits for data from a loader autogaudi may not tune: a script-chosen num_workers
        (worker random streams would differ) or an IterableDataset (only the dataset knows how to
        split its stream); what was measured and what to try is said."""
        if profile.bound != "input":
            return
        workers, _threads = worker_budget()
        share = profile.measured.input_wait_fraction
        if self._iterable_loaders:
            self.report.recommend(
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
        cores = machine_load.physical_cores()
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.report.recommend(
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
            state.from_next_epoch = False
            state.last_end = steps.clock() if state.lifecycle is State.TRIAL else None
        self._starting = state

    def _state(self, iterator):
        state = self._iterators.get(iterator)
        if state is None and self._starting is not None:
            state = self._iterators[iterator] = self._starting
            self._starting = None
        return state

    def _before_batch(self, iterator) -> None:
        # .safety and .worker_iterator load here, once a loader is iterated: a run without one never needs them
        from autogaudi.optimizations.loader_workers.safety import instance_state, random_state

        state = self._state(iterator)
        if state is not None and state.lifecycle is State.WAITING and state.epoch_batches >= WARMUP_BATCHES:
            state.before = (random_state(), instance_state(iterator._dataset))

    def _after_batch(self, iterator, _batch, waited: float) -> None:
        from autogaudi.optimizations.loader_workers.worker_iterator import in_process

        state = self._state(iterator)
        if state is None:
            return
        now = steps.clock()
        window = state.window
        timed = window is not None
        if timed:
            # Before tuning, the first batches of an epoch are not measured: the sampler draws its seed
            # there and the time since the previous epoch's last batch is not a training step.
            counted = state.lifecycle is State.TRIAL or state.epoch_batches >= WARMUP_BATCHES
            # It yields on several ranks (the census starts at one step on each) and while its thread
            # cut waits for the census's model. Another's measurement would read as the step's: the
            # window goes on after it.
            holds = not (several_ranks() or self._cut_waiting) and state.holds_steps(waited, now, CLEARLY_INPUT_BOUND)
            if counted and not self.run.windows.take(self, yields=not holds):
                timed, state.last_end = False, None
            else:
                if state.last_end is not None and counted and not self.run.windows.interrupted:
                    window.add(waited, now - waited - state.last_end)
                    if state.lifecycle is State.WAITING:
                        self._check_getitem(state, iterator._dataset)
                state.last_end = now
        state.epoch_batches += 1
        if timed and measured_enough(window, state.lifecycle):
            self._decide(state, iterator)
            if not any(other.timed for other in self._loaders.values()):
                self.run.windows.release(self)
        if state.epoch_batches == 1 and state.scope is not None and in_process(iterator):
            # a tuned loader's later epoch: its first batch was built here, the rest by workers
            self._start_workers(state, iterator, state.loader())

    def _check_getitem(self, state, dataset) -> None:
        """Whether the measured batch's ``__getitem__`` changed what workers would not give back:
        the global random streams (workers draw from their own) or the dataset's own attributes."""
        from autogaudi.optimizations.loader_workers.safety import (
            changed_attribute,
            instance_state,
            random_state,
            same_random_state,
        )

        if state.before is None or state.getitem_changes is not None:
            return
        random_before, dataset_before = state.before
        attribute = changed_attribute(dataset_before, instance_state(dataset))
        if not same_random_state(random_before, random_state()):
            state.getitem_changes = ("draws_global_random", {})
        elif attribute is not None:
            state.getitem_changes = ("mutates_state", {"attribute": attribute})

    def _decide(self, state, iterator) -> None:
        from autogaudi.optimizations.loader_workers.safety import why_not_workers

        loader = state.loader()
        before, after = state.in_process, state.with_workers
        self._decided = True
        self.run.trials.measured(self)  # decided, whether or not the loader outlives its windows
        if state.lifecycle is State.WAITING:
            self.report.figures["input_bound_fraction"] = round(before.input_bound, 3)
            self.report.figures["ms_per_batch_before"] = round(before.ms_per_batch(worker_budget()[0]), 3)
            if state.getitem_changes is not None:
                self._keep(state, state.getitem_changes[0], **state.getitem_changes[1])
            elif before.input_bound < INPUT_BOUND:
                self._keep(state, "not_starved", share=f"{before.input_bound:.0%}", threshold=f"{INPUT_BOUND:.0%}")
            elif loader is None:  # gone meanwhile
                state.lifecycle = State.REFUSED
            else:
                checked_from = steps.clock()
                why = why_not_workers(loader, self._threads.script_threads())  # before any worker starts
                if state.last_end is not None:  # its samples built are no step's time, nor the workers'
                    state.last_end += steps.clock() - checked_from
                if why is not None:
                    self._keep(state, why[0], **why[1])
                else:
                    self._tune(loader, state, iterator)
        else:
            state.lifecycle = State.ON  # unless no faster: put back
            workers = worker_budget()[0]
            after_ms = after.ms_per_batch(workers)
            self.report.figures["ms_per_batch_after"] = round(after_ms, 3)
            self.report.figures["ms_per_batch_noise"] = round(period_noise_ms(before, after, workers), 3)
            if not workers_faster(before, after, trials.materiality_of(self), workers):
                self._untune(state)
                self._keep(state, "no_faster", after=after_ms, before=before.ms_per_batch(workers))

    def _tune(self, loader, state, iterator) -> None:
        from autogaudi.optimizations.loader_workers.worker_iterator import give_up_all, in_process, set_attributes

        workers, threads = worker_budget()
        measured = state.in_process
        state.workers = workers
        state.bound_s = max(BATCH_BOUND_S, BATCH_BOUND_FACTOR * measured.waited / max(measured.batches, 1))
        state.scope = self.scope.child()
        state.sources = weakref.WeakSet()  # the worker iterators of its epochs
        state.scope.add(lambda: give_up_all(state.sources))
        if threads < self._threads.script_threads():
            self._cut_after_measuring(state)
        self._tuned += 1
        self.report.figures.update(loaders_tuned=self._tuned, workers=workers, main_threads=torch._C.get_num_threads())
        self.report.moment("workers", workers=workers)
        # timed on from the last measured batch, or from the next epoch's start: the workers' start-up
        # counts against them
        if in_process(iterator):
            state.lifecycle = State.TRIAL
            self.report.because("workers", workers=workers)
            if self._start_workers(state, iterator, loader):
                self.report.figures["workers_from_batch"] = state.epoch_batches + 1
        else:  # the script's own workers: raised in place, from the next epoch
            set_attributes(state.scope, loader, num_workers=workers, prefetch_factor=loader.prefetch_factor or 2)
            self._ever_raised = True
            state.lifecycle, state.from_next_epoch = State.TRIAL, True
            self.report.because("workers_raised", workers=workers)

    def _found_model(self, profile) -> None:
        if profile.model is not None:
            self._model = weakref.ref(profile.model)
        if self._cut_waiting and self._measuring is None and self._cut_measured is None:
            self._measure_cut()

    def _cut_after_measuring(self, state) -> None:
        """Cut the main process's threads to the worker budget's for a tuned loader only once the cut is measured
        to leave the training model's outputs bit for bit as the script's threads give them: whether the
        workers stay is a timing, and no timing may choose the numbers. Measured once a run; until then,
        and where it changes an output or cannot be measured, the script's threads stay."""
        if self._cut_measured:
            self._cut(state)
        elif self._cut_measured is None:
            self._cut_waiting.append(state)
            if self._measuring is None:
                self._measure_cut()

    def _cut(self, state) -> None:
        if state.scope is None:  # put back in-process meanwhile
            return
        script = self._threads.script_threads()
        self._threads.hold(state, worker_budget()[1], state.scope)
        if state.lifecycle is State.TRIAL:  # timed with workers from here: with the cores they are given
            state.with_workers, state.last_end = Timing(), None
        self._ever_cut = True
        self.report.note("threads_cut", threads=torch._C.get_num_threads(), script=script)
        self.report.figures["main_threads"] = torch._C.get_num_threads()

    def _cut_not_taken(self, code: str, **values) -> None:
        self._cut_measured = False
        self._cut_waiting = []
        self.report.note(code, script=self._threads.script_threads(), **values)

    def _measure_cut(self) -> None:
        """The thread cut's rounding, once: on the training model's next training call, its output with
        the cut thread count against the script's, both on a copy from the same generator state
        (:func:`autogaudi.measure.numerics.forward_difference`)."""
        model = self._model() if self._model is not None else None
        if model is None and self._model is None and self.run.profiler is not None:
            return  # the step profiler has not named the model yet: measured once it does
        if model is None:
            self._cut_not_taken("threads_kept_no_model")
            return
        if compiled_by_the_script(model):
            self._cut_not_taken("threads_kept_script_compiles")
            return
        self._measuring = self.scope.child()
        self._measuring.hold(model, Layer.MEASURE, functools.partial(self._measured_call, model))

    def _measured_call(self, model, call, args, kwargs):
        if not (model.training and torch.is_grad_enabled()):
            return call(*args, **kwargs)
        self._measuring.close()
        cut, script = worker_budget()[1], self._threads.script_threads()
        if not self._cut_waiting or cut >= script:  # nothing waits for it, or the script set fewer threads
            self._measuring = None
            return call(*args, **kwargs)
        self.report.measure_numerics(
            model,
            args,
            kwargs,
            of="outputs",
            against=f"the script's {script} intra-op threads, on a copy",
            around=with_threads(cut),
            reference=with_threads(script),
        )
        measured = self.report.figures.get("numerics_measured")
        if measured is not None and measured["max_rel_diff"] == 0:
            self._cut_measured = True
            waiting, self._cut_waiting = self._cut_waiting, []
            for state in waiting:
                self._cut(state)
        elif measured is not None:  # the figure is of a cut not taken: the run's numbers are the script's
            del self.report.figures["numerics_measured"]
            self._cut_not_taken("threads_kept_rounding", threads=cut)
        else:  # not measured: measure_numerics' note says why
            self._cut_not_taken("threads_kept_not_measured", threads=cut)
        return call(*args, **kwargs)

    def _start_workers(self, state, iterator, loader) -> bool:
        """Route the rest of the epoch of ``iterator`` to workers; False where they did not start (the
        loader goes back in-process, the epoch goes on there with every batch)."""

        def failed(error):
            with self.fail_open():
                self._workers_failed(state, error)

        from autogaudi.optimizations.loader_workers.worker_iterator import workers_for_rest_of_epoch

        try:
            source = workers_for_rest_of_epoch(iterator, loader, state.workers, state.bound_s, failed)
        except Exception as error:
            self._workers_failed(state, error)
            return False
        state.sources.add(source)
        self.run.steps.route_batches(iterator, source)
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
        scope.close()
        self.report.moment("in_process")
        self._tuned -= 1
        self.report.figures["loaders_tuned"] = self._tuned
        self.report.figures["main_threads"] = torch._C.get_num_threads()
