"""loader_workers on the real CPU: a loader-bound run gets workers from the batch after the measured
ones, in the same epoch, with the same batches, losses and random stream (one-epoch runs and endless
samplers included); compute-bound runs, random __getitem__, explicit choices and iterables are left
alone."""

import gc
import os
import random
import sys
import time
import traceback
from types import SimpleNamespace

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler

import autogaudi
from autogaudi.core.candidate import State
from autogaudi.entry.frames import is_own
from autogaudi.optimizations.loader_workers.loader_state import Timing
from autogaudi.optimizations.loader_workers.unit import (
    CLEARLY_INPUT_BOUND,
    EARLY_BATCHES,
    MEASURED_BATCHES,
    WARMUP_BATCHES,
    measured_enough,
)
from tests.helpers import said

BATCHES_PER_EPOCH = 24
# Real time, as a clock a dataset or a step can take time on: advancing it is sleeping. The tests that
# decide on times take the step clock instead (the ``step_clock`` fixture), and a worker process
# advances its own copy of it: a batch workers build costs the training loop no time.
REAL_TIME = SimpleNamespace(advance=time.sleep)


class Slow(Dataset):
    """``delay`` (2 ms) of ``clock`` per sample: the training step is far cheaper than building its batch."""

    def __init__(self, delay=0.002, noisy=False, clock=REAL_TIME):
        self.delay = delay
        self.noisy = noisy
        self.clock = clock

    def __len__(self):
        return BATCHES_PER_EPOCH * 8

    def __getitem__(self, index):
        self.clock.advance(self.delay)
        features = torch.full((8,), index / len(self))
        if self.noisy:
            features = features + torch.rand(8)  # draws from the process's global generator
        return features, index % 3


def train(loader_factory, epochs=3, width=16, batches=None, children=None, clock=REAL_TIME, compute_s=0.0):
    """``batches``: stop each epoch after that many (a run that never finishes its epoch);
    ``children``: filled with the number of worker processes alive at each batch; each step computes
    for ``compute_s`` of ``clock`` besides its own work."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Dropout(0.2), torch.nn.Linear(width, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = loader_factory()
    losses, seen, workers = [], [], []
    for _ in range(epochs):
        workers.append(loader.num_workers)  # what this epoch's iterator is built with
        for index, (features, labels) in enumerate(loader):
            if batches is not None and index == batches:
                break
            if children is not None:
                children.append(len(psutil.Process().children()))
            loss = torch.nn.functional.cross_entropy(model(features), labels)
            clock.advance(compute_s)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            seen.append(labels.tolist())
    return losses, seen, workers, loader


def only_loader_workers():
    autogaudi.enable(device="cpu", only="loader_workers")
    return autogaudi.report


def row():
    return autogaudi.report().unit("loader_workers")


@pytest.mark.slow
def test_loader_bound_run_gets_workers_with_the_same_batches_and_losses(step_clock):
    make = lambda: DataLoader(Slow(clock=step_clock), batch_size=8, shuffle=True)  # noqa: E731
    plain_losses, plain_seen, plain_workers, _ = train(make)
    script_threads = torch.get_num_threads()
    only_loader_workers()
    children = []
    losses, seen, workers, loader = train(make, children=children, clock=step_clock, compute_s=0.001)
    assert seen == plain_seen and losses == plain_losses  # dropout draws included: the RNG stream is kept
    figures = row()["figures"]
    # warm-up, measured (this loader waits 16 of 17 ms: the short window), then workers in epoch 1,
    # whose batches cost the loop no time
    assert figures["workers_from_batch"] == 2 + EARLY_BATCHES + 1
    assert figures["loaders_tuned"] == 1 and figures["input_bound_fraction"] == round(16 / 17, 3)
    assert (figures["ms_per_batch_before"], figures["ms_per_batch_after"]) == (17.0, 1.0)
    assert figures["ms_per_batch_noise"] == 0.0  # every round alike on the test's clock
    # each later epoch: its first batch in-process, the rest from workers
    later = children[BATCHES_PER_EPOCH:]
    assert min(later[1:BATCHES_PER_EPOCH]) >= 2 and min(later[BATCHES_PER_EPOCH + 1 :]) >= 2
    # what the script observes is what it set: the loader and the thread count are not changed
    assert plain_workers == workers == [0, 0, 0] and loader.num_workers == 0
    assert torch.get_num_threads() == script_threads and torch._C.get_num_threads() == figures["main_threads"]
    autogaudi.disable()
    assert torch._C.get_num_threads() == script_threads  # the cut undone


@pytest.mark.slow
@pytest.mark.parametrize("endless", [False, True], ids=["one-epoch", "endless-sampler"])
def test_a_run_that_never_reaches_a_second_epoch_gets_workers_in_its_first(step_clock, endless):
    """One long epoch, or minGPT's and makemore's endless sampler (RandomSampler with replacement and
    a huge num_samples) left by a break: workers from batch 9 on, same batches, losses and random
    stream; the workers go when the epoch's iterator does."""

    def make():
        dataset = Slow(clock=step_clock)
        if endless:
            sampler = RandomSampler(dataset, replacement=True, num_samples=10**10)
            return DataLoader(dataset, batch_size=8, sampler=sampler)
        return DataLoader(dataset, batch_size=8, shuffle=True)

    plain_losses, plain_seen, _, _ = train(make, epochs=1, batches=22)
    plain_next = torch.rand(3)
    only_loader_workers()
    children = []
    losses, seen, workers, _ = train(make, epochs=1, batches=22, children=children, clock=step_clock, compute_s=0.001)
    assert seen == plain_seen and losses == plain_losses
    assert torch.equal(torch.rand(3), plain_next)  # the new iterator's seed draw was undone
    # waiting holds 16 of 17 ms, past CLEARLY_INPUT_BOUND: decided after the short window
    figures = row()["figures"]
    measured = figures["workers_from_batch"] - 2 - 1
    assert workers == [0] and measured == EARLY_BATCHES and figures["input_bound_fraction"] >= CLEARLY_INPUT_BOUND
    # started as the last measured batch is handed over; the next is the first they build
    assert children[: measured + 1] == [0] * (measured + 1) and min(children[measured + 1 :]) >= 2
    gc.collect()
    assert psutil.Process().children() == []  # the break let go of the epoch's iterator and its workers


@pytest.mark.parametrize(
    "waiting_ms, batches_to_decide",
    [(90, EARLY_BATCHES), (81, EARLY_BATCHES), (79, MEASURED_BATCHES), (55, MEASURED_BATCHES), (10, MEASURED_BATCHES)],
)
def test_a_clearly_starved_loader_is_decided_early_and_a_borderline_one_measured_in_full(waiting_ms, batches_to_decide):
    timing = Timing()
    for batches in range(1, MEASURED_BATCHES + 1):  # noqa: B007 (read after the loop)
        timing.add(waiting_ms / 1000, (100 - waiting_ms) / 1000)
        if measured_enough(timing, State.WAITING):
            break
    assert batches == batches_to_decide
    assert not measured_enough(timing, State.TRIAL) or batches == MEASURED_BATCHES  # re-timing is never cut short


def test_compute_bound_run_is_left_alone(step_clock):
    only_loader_workers()
    make = lambda: DataLoader(Slow(delay=0.0001, clock=step_clock), batch_size=8)  # noqa: E731
    _, _, workers, _ = train(make, epochs=2, clock=step_clock, compute_s=0.004)
    assert workers == [0, 0]
    assert row()["note_codes"] == ["not_starved"]


def test_random_getitem_is_left_alone(step_clock):
    only_loader_workers()
    _, _, workers, _ = train(lambda: DataLoader(Slow(noisy=True, clock=step_clock), batch_size=8), epochs=2)
    assert workers == [0, 0]
    assert row()["note_codes"] == ["draws_global_random"]


class SumsInGetitem(Slow):
    """Each sample adds a sum of 2**20 float32 values, which torch splits across its intra-op threads."""

    def __getitem__(self, index):
        features, label = super().__getitem__(index)
        return features + (torch.linspace(0, 1, 2**20) * 1.1).sum(), label


def test_a_dataset_whose_samples_round_otherwise_on_one_thread_stays_in_process(starving):
    """Each worker runs one intra-op thread: a sample whose own sum splits across the script's threads
    would come out otherwise there, and whether workers stay is a timing (no timing may choose the numbers)."""
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one intra-op thread here: a worker's sums add as the script's")
    only_loader_workers()
    _, _, workers, _ = train(lambda: DataLoader(SumsInGetitem(), batch_size=8), epochs=2)
    assert workers == [0, 0] and row()["figures"]["loaders_tuned"] == 0
    assert ("rounds_otherwise", {"threads": threads}) in said(row()) and row()["numerics"] == []


def test_the_sample_check_judges_on_the_threads_it_is_given_and_leaves_the_cut_as_it_was():
    from autogaudi.optimizations.loader_workers.safety import rounds_otherwise_in_a_worker

    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one intra-op thread here")
    torch._C.set_num_threads(1)  # as while another loader's workers hold the cut
    try:
        assert rounds_otherwise_in_a_worker(SumsInGetitem(), threads)
        assert not rounds_otherwise_in_a_worker(Slow(), threads)
        assert torch._C.get_num_threads() == 1
    finally:
        torch._C.set_num_threads(threads)


def test_explicit_choices_subclasses_and_iterables_are_left_alone():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    class MyLoader(DataLoader):
        pass

    only_loader_workers()
    assert (row()["status"], row()["reason_code"]) == ("watching", "no_loader")
    explicit = DataLoader(Slow(delay=0), batch_size=8, num_workers=0)
    mine = MyLoader(Slow(delay=0), batch_size=8)
    stream = DataLoader(Stream(), batch_size=2)
    for loader in (explicit, mine, stream):
        for _ in loader:
            pass
        assert loader.num_workers == 0
    assert row()["figures"]["loaders_kept"] == 2  # the subclass is not even considered
    assert row()["note_codes"] == ["script_chose_workers", "iterable_dataset"]
    # nothing was measured: the reason is the last loader kept (the notes name each), not a measurement
    assert (row()["status"], row()["reason_code"]) == ("watching", "iterable_dataset")


@pytest.mark.slow
def test_spawned_workers_under_the_launcher_unpickle_the_scripts_dataset(tmp_path):
    """Spawned workers are fresh interpreters that import the script's __main__ to unpickle its
    dataset. Whether they are kept is the re-timing's call (their ~2 s start-up here is close to what
    they save on this short run); that they started, fed batches and changed nothing is the test."""
    import json

    from tests.helpers import SCRIPTS, run_python

    plain = run_python(SCRIPTS / "loader_spawn.py")
    tuned = run_python(
        "-m", "autogaudi", "--quiet", "--only", "loader_workers", "--report", tmp_path / "report.json",
        SCRIPTS / "loader_spawn.py",
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert tuned.returncode == 0, tuned.stderr
    plain, tuned = json.loads(plain.stdout), json.loads(tuned.stdout)
    assert tuned["losses"] == plain["losses"]
    (unit,) = [
        row for row in json.loads((tmp_path / "report.json").read_text())["units"] if row["name"] == "loader_workers"
    ]
    assert unit["status"] != "failed" and unit["figures"]["workers_from_batch"] <= 2 + MEASURED_BATCHES + 1, unit
    assert unit["figures"]["ms_per_batch_after"] > 0  # the workers built the batches that were re-timed
    assert plain["workers"] == [0, 0, 0] and tuned["workers"][0] == 0


def train_one_epoch(loader, clock):
    """A linear model's epoch over ``loader``: a step (1 ms of ``clock``) far cheaper than building its batch."""
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, labels in loader:
        clock.advance(0.001)
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("chosen, advised", [(0, True), (64, False)])
def test_a_starving_loader_the_script_configured_gets_advice_not_a_change(step_clock, chosen, advised):
    """ResNet-18 with the script's -j 4 on 16 cores waited for data 68% of each step: autogaudi keeps
    the script's num_workers and says what it measured and what to try (not where the script already
    asked for more workers than the machine's budget)."""
    from autogaudi.optimizations.loader_workers.thread_cut import worker_budget

    autogaudi.enable(device="cpu", only="step_profiler,loader_workers")
    loader = DataLoader(Slow(clock=step_clock), batch_size=8, num_workers=chosen)
    loader.num_workers = 0  # the test's run stays in-process; autogaudi saw the script's choice
    train_one_epoch(loader, step_clock)
    assert autogaudi.report().unit("step_profiler")["figures"]["bound"] == "input"
    assert loader.num_workers == 0  # nothing changed on the script's loader
    advice = autogaudi.report().recommended()
    if advised:
        (row,) = advice
        assert (row["unit"], row["code"]) == ("loader_workers", "more_workers")
        assert (row["params"]["chosen"], row["params"]["workers"]) == (0, worker_budget()[0])
        assert row["do"].startswith(f"num_workers={worker_budget()[0]} ") and row["saves_basis"] == "measured"
    else:
        assert advice == []


def test_a_starving_iterable_dataset_stays_in_process_with_advice_on_sharding(step_clock):
    """Workers over an IterableDataset each replay the whole stream unless it shards itself, which
    only the dataset can do: autogaudi keeps it in-process and says how to make workers safe."""
    from autogaudi.optimizations.loader_workers.thread_cut import worker_budget

    class SlowStream(IterableDataset):
        def __iter__(self):
            slow = Slow(clock=step_clock)
            return (slow[index] for index in range(len(slow)))

    autogaudi.enable(device="cpu", only="step_profiler,loader_workers")
    loader = DataLoader(SlowStream(), batch_size=8)
    train_one_epoch(loader, step_clock)
    assert loader.num_workers == 0 and row()["figures"]["loaders_tuned"] == 0
    (advice,) = autogaudi.report().recommended()
    assert (advice["code"], advice["params"]["workers"]) == ("shard_iterable", worker_budget()[0])


@pytest.mark.slow
@pytest.mark.parametrize("chosen", [0, 1])
def test_forced_a_starving_loader_the_script_configured_is_measured_and_raised(starving, chosen):
    """--force loader_workers: the script's num_workers below the budget is measured like any other;
    num_workers=0 goes on with workers inside the same epoch, 1 is raised from the next epoch. The
    batches come from the main-process sampler either way: same batches and losses here (this
    dataset draws no random numbers; the note says what differs where it would). Starving by fixture:
    the script's own worker builds its batches where the step clock does not move, and on real time
    a machine at load 5 slowed this tiny step to 40 ms, as long as the worker's wait."""
    from autogaudi.optimizations.loader_workers.thread_cut import worker_budget

    make = lambda: DataLoader(Slow(), batch_size=8, shuffle=True, num_workers=chosen)  # noqa: E731
    plain_losses, plain_seen, plain_workers, _ = train(make)
    autogaudi.enable(device="cpu", only="loader_workers", force="loader_workers")
    losses, seen, workers, loader = train(make)
    assert seen == plain_seen and losses == plain_losses
    budget = worker_budget()[0]
    # num_workers=0 is routed to workers, the loader untouched; the script's own workers are raised in
    # place, which the script can read, and the reason code says so
    assert plain_workers == [chosen] * 3 and workers == ([0, 0, 0] if chosen == 0 else [1, budget, budget])
    figures = row()["figures"]
    assert figures["loaders_tuned"] == 1 and ("workers_from_batch" in figures) == (chosen == 0)
    assert row()["reason_code"] == ("workers" if chosen == 0 else "workers_raised")
    assert ("forced_measured", {"chosen": chosen}) in said(row())
    autogaudi.disable()
    assert loader.num_workers == chosen  # the script's choice, put back


@pytest.fixture
def starving(monkeypatch):
    """Every measured loader counts as starving the step, and its workers as faster: what happens
    next does not hang on how loaded this machine is."""
    from autogaudi.optimizations.loader_workers import unit

    monkeypatch.setattr(unit, "INPUT_BOUND", 0.0)
    monkeypatch.setattr(unit, "CLEARLY_INPUT_BOUND", 0.0)  # decided after the short window
    monkeypatch.setattr(unit, "MEASURED_BATCHES", EARLY_BATCHES)  # re-timed as briefly
    monkeypatch.setattr(unit, "workers_faster", lambda before, after, materiality, workers: True)  # and never put back


@pytest.mark.slow
def test_an_unguarded_spawn_script_stays_in_process_instead_of_hanging(tmp_path):
    """Its workers would re-run the script and die at its top-level set_start_method, and starting
    them blocks on a pipe nobody drains: it is kept in-process, checked before any worker starts."""
    import json

    from tests.helpers import SCRIPTS, run_python

    script = SCRIPTS / "loader_spawn_unguarded.py"
    plain = run_python(script)
    tuned = run_python(
        "-m", "autogaudi", "--quiet", "--only", "loader_workers", "--report", tmp_path / "r.json", script
    )
    assert plain.returncode == 0 and tuned.returncode == 0, tuned.stderr
    assert json.loads(tuned.stdout) == json.loads(plain.stdout)
    (unit,) = [row for row in json.loads((tmp_path / "r.json").read_text())["units"] if row["name"] == "loader_workers"]
    assert unit["reason_code"] == "main_reruns" and unit["figures"]["kept_because"] == {"main_reruns": 1}, unit


@pytest.mark.parametrize(
    "source, safe",
    [
        ('"""doc"""\nimport torch\nN = 3\nclass A:\n    pass\nif __name__ == "__main__":\n    train()\n', True),
        ("try:\n    import apex\nexcept ImportError:\n    apex = None\nSIZES = (1, 2)\n", True),
        ("import torch.multiprocessing as mp\nmp.set_start_method('spawn')\n", False),
        ("import argparse\nARGS = argparse.ArgumentParser().parse_args()\n", False),
        ("import sys\nPATH = sys.argv[1]\n", False),
        ('if __name__ == "__main__":\n    pass\nelse:\n    train()\n', False),
        ("def broken(:\n", False),
    ],
    ids=["guarded", "try-import", "set-start-method", "argparse", "argv", "else-branch", "syntax-error"],
)
def test_a_main_is_safe_to_rerun_in_a_worker_only_when_it_only_defines_and_imports(tmp_path, source, safe):
    from autogaudi.optimizations.loader_workers.safety import main_reruns_safely

    script = tmp_path / "script.py"
    script.write_text(source)
    assert main_reruns_safely(str(script)) is safe


class Augmenting(Dataset):
    """Random augmentation from a generator of its own: each worker would draw from a copy."""

    def __init__(self, kind):
        import numpy

        self.rng = {
            "random": lambda: random.Random(123),
            "numpy-randomstate": lambda: numpy.random.RandomState(123),
            "numpy-generator": lambda: numpy.random.default_rng(123),
            "torch": lambda: torch.Generator().manual_seed(123),
        }[kind]()

    def __len__(self):
        return BATCHES_PER_EPOCH * 8

    def __getitem__(self, index):
        time.sleep(0.001)
        if isinstance(self.rng, random.Random):
            noise = self.rng.random()
        elif isinstance(self.rng, torch.Generator):
            noise = torch.rand((), generator=self.rng).item()
        else:
            noise = float(self.rng.random() if hasattr(self.rng, "bit_generator") else self.rng.rand())
        return torch.full((8,), index / len(self) + noise), index % 3


@pytest.mark.parametrize("kind", ["random", "numpy-randomstate", "numpy-generator", "torch"])
def test_a_dataset_with_its_own_generator_keeps_the_plain_runs_samples(starving, kind):
    make = lambda: DataLoader(Augmenting(kind), batch_size=8, shuffle=True)  # noqa: E731
    plain_losses, plain_seen, _, _ = train(make, epochs=1)
    only_loader_workers()
    losses, seen, _, _ = train(make, epochs=1)
    assert losses == plain_losses and seen == plain_seen
    assert row()["reason_code"] == "holds_generator" and row()["figures"]["loaders_tuned"] == 0


class Counting(Slow):
    """Counts its calls and caches what it built: workers would count and cache in their copies."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.cache = {}

    def __getitem__(self, index):
        self.calls += 1
        self.cache[index] = item = super().__getitem__(index)
        return item


def test_a_dataset_that_counts_or_caches_keeps_the_plain_runs_counts(starving):
    plain = Counting()
    train(lambda: DataLoader(plain, batch_size=8, shuffle=True), epochs=2)
    only_loader_workers()
    dataset = Counting()
    train(lambda: DataLoader(dataset, batch_size=8, shuffle=True), epochs=2)
    assert dataset.calls == plain.calls == 2 * BATCHES_PER_EPOCH * 8 and len(dataset.cache) == len(plain.cache)
    assert row()["reason_code"] == "mutates_state" and row()["reason_params"] == {"attribute": "cache"}


def test_a_dataset_that_does_not_pickle_stays_in_process_under_spawn(starving):
    """Under spawn the workers get the dataset pickled: checked before they start."""
    import multiprocessing

    previous = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("spawn", force=True)
    try:
        dataset = Slow()
        dataset.transform = lambda features: features  # a lambda does not pickle
        only_loader_workers()
        _, seen, _, _ = train(lambda: DataLoader(dataset, batch_size=8), epochs=1)
    finally:
        multiprocessing.set_start_method(previous, force=True)
    assert seen == [[index % 3 for index in range(start, start + 8)] for start in range(0, len(dataset), 8)]
    assert row()["reason_code"] == "not_picklable" and "lambda" in row()["reason_params"]["error"]


class DiesInWorkers(Slow):
    """Fine in-process; in a worker it exits, or never returns."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def __getitem__(self, index):
        if torch.utils.data.get_worker_info() is not None:
            if self.how == "exit":
                os._exit(3)
            time.sleep(600)
        return super().__getitem__(index)


@pytest.mark.parametrize("how", ["exit", "stall"])
def test_workers_that_die_or_stall_hand_the_epoch_back_with_the_same_batches(starving, monkeypatch, how):
    """A failed attempt: the workers go, the batches they had not yielded are built in-process (none
    lost, none twice), and the reason code says so. For the stall the bound is shortened, and the
    stall is far longer than it; workers that exit keep the full bound, so that however slowly a
    loaded machine starts them, their death is found before it passes."""
    from torch.utils.data import _utils

    from autogaudi.optimizations.loader_workers import worker_iterator

    if how == "stall":
        monkeypatch.setattr(worker_iterator, "START_BOUND_S", 1.0)
    monkeypatch.setattr(_utils, "MP_STATUS_CHECK_INTERVAL", 0.2)  # how often a dead worker is looked for
    make = lambda: DataLoader(DiesInWorkers(how), batch_size=8, shuffle=True)  # noqa: E731
    plain_losses, plain_seen, _, _ = train(make, epochs=2)
    only_loader_workers()
    losses, seen, _, _ = train(make, epochs=2)
    assert seen == plain_seen and losses == plain_losses
    assert row()["reason_code"] == "workers_failed" and row()["figures"]["loaders_tuned"] == 0
    assert ("RuntimeError" if how == "exit" else "_TooSlow") in row()["reason_params"]["error"]
    notes = [note for note in said(row()) if not note[0].startswith("threads_")]  # the cut, taken or not
    assert notes == [("workers_failed", row()["reason_params"])]  # and no note from the undo
    # only loader_workers runs (no step profiler names the model): the threads stay the script's, and
    # workers that build the plain batches change no number
    assert "threads_kept_no_model" in row()["note_codes"] and row()["numerics"] == []
    gc.collect()
    assert psutil.Process().children() == []


def test_no_worker_is_left_to_torchs_sigchld_handler_while_the_indices_are_put(monkeypatch):
    """torch's SIGCHLD handler raises wherever the main thread is; raised inside an index queue's put
    it leaves the queue's lock held, and the shutdown's own put then hangs. The workers autogaudi
    starts are unregistered before the first index goes out (their deaths are found by polling)."""
    from autogaudi.optimizations.loader_workers import worker_iterator

    registered = []
    put_index = worker_iterator._WorkerIterator._try_put_index
    monkeypatch.setattr(
        worker_iterator._WorkerIterator,
        "_try_put_index",
        lambda self: registered.append(self._worker_pids_set) or put_index(self),
    )
    loader = DataLoader(Slow(delay=0), batch_size=8)
    in_process = iter(loader)
    first = next(in_process)
    source = worker_iterator.workers_for_rest_of_epoch(in_process, loader, 1, 60.0, failed=pytest.fail)
    rest = list(source)
    assert registered and not any(registered)
    assert torch.cat([first[0], *(batch[0] for batch in rest)]).shape[0] == len(loader.dataset)
    del source
    gc.collect()


def test_the_script_reads_and_sets_its_own_thread_count_while_workers_take_cores(starving, monkeypatch):
    from autogaudi.optimizations.loader_workers.thread_cut import worker_budget
    from autogaudi.optimizations.loader_workers.unit import LoaderWorkers

    # the cut taken at once (no model here to measure it on: the tests below measure it)
    monkeypatch.setattr(LoaderWorkers, "_cut_after_measuring", LoaderWorkers._cut)
    script_threads = torch.get_num_threads()
    only_loader_workers()
    loader = DataLoader(Slow(), batch_size=8)
    read = []
    for index, _batch in enumerate(loader):
        read.append(torch.get_num_threads())
        if index == BATCHES_PER_EPOCH - 2:
            torch.set_num_threads(3)  # the script's own choice, while the threads are cut
    assert row()["figures"]["loaders_tuned"] == 1 and loader.num_workers == 0
    assert read[:-1] == [script_threads] * (BATCHES_PER_EPOCH - 1) and read[-1] == 3
    assert torch._C.get_num_threads() == min(3, worker_budget()[1])
    # the report names what the cut can change in the numbers, and by how many threads
    assert row()["numerics"] == ["rounding"] and row()["numerics_measured"] is None
    if worker_budget()[1] < script_threads:
        assert ("threads_cut", {"threads": worker_budget()[1], "script": script_threads}) in said(row())
    autogaudi.disable()
    assert torch.get_num_threads() == 3  # the script's number, the cut undone
    torch.set_num_threads(script_threads)


def _cut_run(delay):
    """A starving loader's run under step_profiler and loader_workers: losses, parameters, streams."""
    autogaudi.enable(device="cpu", only="step_profiler,loader_workers")
    make = lambda: DataLoader(Slow(delay=delay), batch_size=8)  # noqa: E731
    random.seed(4)
    # two epochs: the census waits for the loader's two windows, and the cut is measured once it is profiled
    losses, *_ = train(make, epochs=2)
    return losses, torch.get_rng_state(), random.getstate()


def test_the_thread_cut_is_measured_on_a_copy_of_the_profiled_model_and_leaves_the_run_as_it_was(starving, monkeypatch):
    from autogaudi.core import unit_report
    from autogaudi.optimizations.loader_workers.thread_cut import worker_budget

    if worker_budget()[1] >= torch.get_num_threads():
        pytest.skip("no thread cut on this machine")
    measured = _cut_run(0.0)
    figure = row()["figures"]["numerics_measured"]
    assert (figure["of"], figure["steps"], figure["max_rel_diff"]) == ("outputs", 1, 0.0)
    assert "threads_cut" in row()["note_codes"] and row()["numerics"] == ["rounding"]
    autogaudi.disable()
    # the same verdict without running the copy: the measurement itself moved nothing
    monkeypatch.setattr(unit_report.numerics, "forward_difference", lambda *args, **kwargs: 0.0)
    unmeasured = _cut_run(0.0)
    assert measured[0] == unmeasured[0]  # dropout draws included
    assert torch.equal(measured[1], unmeasured[1]) and measured[2] == unmeasured[2]


def test_workers_are_timed_beside_the_thread_cut_they_keep(starving, monkeypatch):
    """The cut is measured on the model the census names, after the loader was tuned: the window with
    workers gives the steps to the census meanwhile and is timed from the cut on, since workers beside
    the script's threads (more threads than cores) are not the workers that stay."""
    from autogaudi.optimizations.loader_workers import loader_state
    from autogaudi.optimizations.loader_workers.thread_cut import worker_budget

    if worker_budget()[1] >= torch.get_num_threads():
        pytest.skip("no thread cut on this machine")
    threads_timed = []  # (window, intra-op threads) of each batch timed
    add = loader_state.Timing.add

    def add_and_count_threads(window, waited, computed):
        threads_timed.append((window, torch._C.get_num_threads()))
        add(window, waited, computed)

    monkeypatch.setattr(loader_state.Timing, "add", add_and_count_threads)
    _cut_run(0.0)
    assert row()["figures"]["main_threads"] == worker_budget()[1] and "threads_cut" in row()["note_codes"]
    decided_on = threads_timed[-1][0]  # the with-workers window the decision read
    assert {threads for window, threads in threads_timed if window is decided_on} == {worker_budget()[1]}
    assert decided_on.batches >= EARLY_BATCHES  # the window the fixture sets, timed whole


def test_a_thread_cut_that_changes_the_outputs_is_not_taken(starving, monkeypatch):
    """Whether workers stay is a timing: a cut that rounds the training forward otherwise would let
    the machine's load choose the numbers, so the script's threads stay beside the workers."""
    from autogaudi.core import unit_report
    from autogaudi.optimizations.loader_workers.thread_cut import worker_budget

    script_threads = torch.get_num_threads()
    if worker_budget()[1] >= script_threads:
        pytest.skip("no thread cut on this machine")
    monkeypatch.setattr(unit_report.numerics, "forward_difference", lambda *args, **kwargs: 3e-7)
    _cut_run(0.0)
    assert row()["figures"]["loaders_tuned"] == 1  # workers kept
    assert ("threads_kept_rounding", {"script": script_threads, "threads": worker_budget()[1]}) in said(row())
    assert "threads_cut" not in row()["note_codes"] and row()["numerics"] == []
    assert row()["numerics_measured"] is None and row()["figures"]["main_threads"] == script_threads


def test_without_a_training_model_the_thread_cut_is_not_taken(starving):
    from autogaudi.optimizations.loader_workers.thread_cut import worker_budget

    script_threads = torch.get_num_threads()
    if worker_budget()[1] >= script_threads:
        pytest.skip("no thread cut on this machine")
    only_loader_workers()
    train(lambda: DataLoader(Slow(delay=0.0), batch_size=8), epochs=1)
    assert ("threads_kept_no_model", {"script": script_threads}) in said(row())
    assert row()["numerics_measured"] is None and row()["numerics"] == []
    assert row()["figures"]["main_threads"] == script_threads


class RaisesAt(Slow):
    """Raises the script's own error at one index, wherever it is built."""

    def __getitem__(self, index):
        if index == 12 * 8:
            raise ValueError(index)
        return super().__getitem__(index)


def test_a_users_error_met_by_the_workers_reaches_the_script_without_autogaudis_frames(starving):
    only_loader_workers()
    with pytest.raises(ValueError) as caught:
        train(lambda: DataLoader(RaisesAt(), batch_size=8), epochs=1)
    assert row()["reason_code"] == "workers_failed" and "ValueError" in row()["reason_params"]["error"]
    frames = [frame.filename for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert frames[-1] == __file__ and not [name for name in frames if is_own(name)]


class ExitsAt(Slow):
    """Notes its visit to one index in a file (seen from any process), then calls sys.exit(9)."""

    def __init__(self, visits):
        super().__init__()
        self.visits = visits

    def __getitem__(self, index):
        if index == 12 * 8:
            with open(self.visits, "a") as handle:
                handle.write(f"{index}\n")
            sys.exit(9)
        return super().__getitem__(index)


def test_sys_exit_in_a_worker_exits_the_script_once_as_in_process(starving, tmp_path):
    visits = tmp_path / "visits"
    only_loader_workers()
    with pytest.raises(SystemExit) as caught:
        train(lambda: DataLoader(ExitsAt(visits), batch_size=8), epochs=1)
    assert caught.value.code == 9
    assert visits.read_text() == "96\n"  # the item's side effect ran once, as in the plain run
    assert row()["figures"]["loaders_tuned"] == 1  # the workers had taken over the epoch


def test_a_loaders_window_waits_while_another_measurement_holds_the_steps(step_clock):
    """A census or a timed update holding the steps would read as the loader's compute: its window
    starts once they let go (here, once the other hold goes stale) and gives them back decided."""
    from autogaudi.entry import runtime
    from autogaudi.measure import trials

    only_loader_workers()
    windows = runtime._STATE.session.windows
    assert windows.take(SimpleNamespace(name="other"))
    loader = DataLoader(Slow(clock=step_clock), batch_size=8)
    held = trials.STALE_STEPS - WARMUP_BATCHES  # counted batches while the other holds
    train(lambda: loader, epochs=1, batches=WARMUP_BATCHES + held + 2, clock=step_clock, compute_s=0.1)
    assert windows.holder is runtime._STATE.session.unit("loader_workers")
    assert row()["status"] == "deciding" and "input_bound_fraction" not in row()["figures"]
    train(lambda: loader, epochs=1, clock=step_clock, compute_s=0.1)
    assert windows.holder is None and row()["status"] == "not needed"
    assert row()["figures"]["ms_per_batch_before"] > 0


def test_a_loaders_window_leaves_out_each_batch_whose_period_held_another_measurements_step(step_clock):
    """A loader that does not clearly starve the step gives it to the census between its batches: the
    period up to its next batch holds the census step's work (tens of milliseconds a step on the
    2-core CPU), which plain's batches never pay. Counted, it made the batch in-process read slower
    than plain's and the report claim a saving the workers never made."""
    from autogaudi.entry import runtime

    only_loader_workers()
    windows, census = runtime._STATE.session.windows, SimpleNamespace(name="census")
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for index, (inputs, labels) in enumerate(DataLoader(Slow(clock=step_clock), batch_size=8)):
        step_clock.advance(0.008)  # the step's own compute: a third of the batch's time
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        if index in (3, 5, 7, 9) and windows.take(census):  # census steps, as the profiler alternates them
            step_clock.advance(0.5)
            windows.release(census)
        optimizer.step()
        optimizer.zero_grad()
    assert row()["figures"]["ms_per_batch_before"] == 24.0  # 16 ms waited, 8 computed: no census step in it


@pytest.mark.parametrize(
    "several, compute_s, others_wait",
    [(False, 0.001, True), (True, 0.001, False), (False, 0.1, False)],
    ids=["starved", "starved-on-several-ranks", "not-starved"],
)
def test_a_clearly_starved_loaders_window_holds_the_steps_on_one_process_and_gives_way_otherwise(
    step_clock, monkeypatch, several, compute_s, others_wait
):
    """A clearly starved loader's batches are a run's slowest: on one process it is decided first, and
    the census and trials after it measure the step its workers feed. On several ranks those start at
    the same step on each, and a loader that does not clearly starve the step would delay every other
    decision: the window gives way to them."""
    from autogaudi.entry import runtime
    from autogaudi.optimizations.loader_workers import unit as loader_unit

    monkeypatch.setattr(loader_unit, "several_ranks", lambda: several)
    only_loader_workers()
    windows = runtime._STATE.session.windows
    loader = DataLoader(Slow(clock=step_clock), batch_size=8)
    train(lambda: loader, epochs=1, batches=WARMUP_BATCHES + 3, clock=step_clock, compute_s=compute_s)
    assert windows.holder is runtime._STATE.session.unit("loader_workers")
    assert windows.take(SimpleNamespace(name="census")) is not others_wait


def test_a_decided_loader_still_reads_decided_once_the_script_dropped_it(step_clock):
    only_loader_workers()
    train(lambda: DataLoader(Slow(clock=step_clock), batch_size=8), epochs=1, clock=step_clock, compute_s=0.1)
    gc.collect()
    assert row()["status"] == "not needed" and row()["reason_code"] == "none_starved"


def test_a_windows_period_is_its_typical_round_which_a_one_off_batch_does_not_move():
    """The report's batch before and after (and what it says the workers saved) read the rule's rounds:
    in a window of six, the checks before tuning would otherwise stand for every batch of the run."""
    window = Timing()
    for seconds in (0.010, 0.010, 0.010, 0.010, 0.010, 0.190):
        window.add(seconds, 0.0)
    assert window.ms_per_batch(2) == pytest.approx(10.0)
    assert window.ms_per_batch(1) == pytest.approx(10.0)


@pytest.mark.parametrize("with_workers_ms, kept", [(9.6, False), (9.4, True)])
def test_workers_are_kept_only_for_a_gain_material_to_the_batch_as_every_change_to_the_numbers(with_workers_ms, kept):
    """Workers change the numbers (their random streams, the thread cut's rounding): 4% faster, beyond
    the margin and with no spread, is still under the 5% of the batch's period every such change must
    save; 6% is not."""
    from autogaudi.measure import trials
    from autogaudi.optimizations.loader_workers.loader_state import Timing
    from autogaudi.optimizations.loader_workers.unit import workers_faster

    before, after = Timing(), Timing()
    for _ in range(16):
        before.add(0.008, 0.002)
        after.add(with_workers_ms / 1000 - 0.002, 0.002)
    assert workers_faster(before, after, trials.MATERIAL) is kept
    assert workers_faster(before, after, 0.0)  # a change that left the numbers alone: the margin is enough


def test_workers_are_judged_on_rounds_of_one_batch_per_worker():
    """Two workers hand over a batch that waited its whole build, then one ready at once: single
    batches alternate 45 and 12 ms, whose spread hides a period of 28.5 ms against 35 in-process."""
    from autogaudi.measure import trials
    from autogaudi.optimizations.loader_workers.loader_state import Timing
    from autogaudi.optimizations.loader_workers.unit import workers_faster

    before, after = Timing(), Timing()
    for index in range(6):
        before.add(0.033 + 0.001 * (index % 2), 0.001)
    for index in range(16):
        after.add((0.044 if index % 2 == 0 else 0.011) + 0.002 * (index % 3 == 0), 0.001)
    assert not workers_faster(before, after, trials.MATERIAL, workers=1)  # batch by batch: within the spread
    assert workers_faster(before, after, trials.MATERIAL, workers=2)
