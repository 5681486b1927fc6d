"""step_profiler: the classification rule, CPU fixtures that are host-, device- and input-bound,
one stalled step that must not flip them, the HPU path through the double's timing hook, and which
module it names as the training model."""

import gc
import importlib
import json
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils.data import DataLoader, Dataset

import autogaudi
from autogaudi.entry import runtime
from autogaudi.measure import clock as measure_clock
from autogaudi.optimizations.step_profiler import classification
from autogaudi.optimizations.step_profiler.census import new_census
from autogaudi.optimizations.step_profiler.classification import (
    DECIDING_PAIRS,
    PAIRS,
    census_figures,
    classify,
    pair_shares,
    settled,
)
from tests.helpers import SCRIPTS, clean_env, run_python, said
from tests.optimizations.ddp_helpers import PLAIN_TORCHRUN, TORCHRUN, torchrun

STEPS = 3 + 2 * PAIRS + 2  # warm-up, the clean and census steps, and a couple more


def test_classification_rule():
    assert classify(waiting=0.6, busy=0.3)[0] == "input"
    assert classify(waiting=0.1, busy=0.3)[0] == "host"
    assert classify(waiting=0.1, busy=0.8)[0] == "device"
    # waiting for collectives is neither ops nor issuing them
    assert classify(waiting=0.1, busy=0.2, collective=0.2)[0] == "host"
    assert classify(waiting=0.1, busy=0.2, collective=0.4)[0] == "communication"
    assert classify(waiting=0.1, busy=0.4, collective=0.2)[0] == "device"


def test_the_median_pair_decides_and_waits_are_shares_of_the_clean_steps():
    """Given (clean step, wait) and census (ops, busy, collective wait, unfutured) figures: one stalled
    census step (busy 0.3 s) is outvoted, and one stalled clean step only lowers its own pair's share."""
    clean = [(0.010, 0.002)] * PAIRS
    censuses = [(40, 0.001, None, 0)] * (PAIRS - 1) + [(40, 0.3, None, 0)]
    figures, shares = census_figures(clean, censuses)
    assert classify(*shares)[0] == "host" and shares[:3] == pytest.approx((0.2, 0.1, 0.0))
    assert figures.compute_fraction_range == [0.1, 1.0] and figures.ms_per_step == 10.0
    assert figures.collective_wait_fraction is None and figures.ops_per_step == 40
    assert "collective_wait_fraction" not in figures.as_dict()  # not measured: not in the report

    clean = [(0.5, 0.0)] + [(0.010, 0.0)] * (PAIRS - 1)
    figures, shares = census_figures(clean, [(40, 0.008, 0.0, 1)] * PAIRS)
    assert classify(*shares)[0] == "device" and figures.compute_fraction == 0.8
    assert figures.collective_wait_fraction == 0.0 and figures.collectives_without_future_per_step == 1

    clean = [(0.010, 0.0)] * PAIRS
    _, shares = census_figures(clean, [(40, 0.001, 0.006, 0)] * PAIRS)
    assert classify(*shares)[0] == "communication"


def test_a_step_within_the_noise_of_the_host_bound_line_is_unclear():
    assert classify(waiting=0.1, busy=0.48)[0] == "unclear"  # within the least band
    assert classify(waiting=0.1, busy=0.4)[0] == "host"
    assert classify(waiting=0.1, busy=0.4, spread=0.12)[0] == "unclear"  # the pairs' own spread widens it
    assert classify(waiting=0.1, busy=0.3, spread=1.0)[0] == "host"  # never past MAX_BAND
    assert classify(waiting=0.1, busy=0.2, collective=0.28)[0] == "unclear"


def flips(noises, busy_machine=False) -> int:
    """Of pairs of identical runs (the step's true compute share from 0.2 to 0.8, each census pair off
    by ``noises`` of a step), how many read host-bound in one run and device-bound in the other."""
    generator = torch.Generator().manual_seed(0)
    count = 0
    for true_share in [0.2 + 0.05 * step for step in range(13)]:
        for noise in noises:
            for _ in range(40):
                reads = set()
                for _run in range(2):
                    drawn = true_share + noise * torch.randn(PAIRS, generator=generator)
                    censuses = [(40, 0.010 * max(float(share), 0.0), None, 0) for share in drawn]
                    shares = census_figures([(0.010, 0.0)] * PAIRS, censuses, busy_machine)[1]
                    reads.add(classify(*shares)[0])
                count += {"host", "device"} <= reads
    return count


def test_identical_runs_never_read_host_bound_in_one_and_device_bound_in_another(monkeypatch):
    """Generated: on a quiet machine with 2-5% noise per census pair, on a busy one with up to 15%;
    without the band the same runs flip."""
    assert flips((0.02, 0.05)) == 0
    assert flips((0.02, 0.05, 0.1, 0.15), busy_machine=True) == 0
    monkeypatch.setattr(classification, "MIN_BAND", 0.0)
    monkeypatch.setattr(classification, "MAX_BAND", 0.0)
    assert flips((0.02, 0.05)) > 0


def test_pairs_that_settle_early_read_as_every_pair_would():
    """Generated: wherever the first pairs settle the census, the median of all PAIRS pairs is on the same
    side of the host-bound line however the pairs not taken would have read (from nothing to ten
    times a step)."""
    generator = torch.Generator().manual_seed(0)
    shares = lambda n: (torch.rand(n, generator=generator) * 1.2).tolist()  # noqa: E731
    settled_early = 0
    for _ in range(500):
        clean = [(0.010, 0.0)] * PAIRS
        censuses = [(40, 0.010 * share, None, 0) for share in shares(PAIRS)]
        for taken in range(DECIDING_PAIRS, PAIRS):
            if not settled(clean[:taken], censuses[:taken]):
                continue
            settled_early += 1
            early = classify(*census_figures(clean[:taken], censuses[:taken])[1])[0]
            for rest in ([(40, 0.0, None, 0)], [(40, 0.1, None, 0)]):
                every = censuses[:taken] + rest * (PAIRS - taken)
                assert classify(*census_figures(clean, every)[1])[0] == early
            assert {classify(0.0, busy)[0] for _, busy, _ in pair_shares(clean[:taken], censuses[:taken])} == {early}
            break
    assert 20 < settled_early < 500  # both ways seen: some settle early, most take every pair


@torch.library.custom_op("autogaudi_tests::takes", mutates_args=())
def takes(inputs: torch.Tensor, seconds: float) -> torch.Tensor:
    """An op whose kernel computes for ``seconds`` of the step clock (the ``step_clock`` fixture's)."""
    measure_clock.now.advance(seconds)
    return inputs.clone()


class Timed(nn.Module):
    """``model``, each call taking ``host`` seconds of the step clock in Python (issuing ops) and
    ``device`` seconds inside an op; call ``stall_at`` (1-based) also stalls ``stall_s``, in Python
    or inside an op (what the census sees when the OS preempts a kernel)."""

    def __init__(self, model, host=0.0, device=0.0, stall_at=None, stall_s=0.0, stall_in_op=False):
        super().__init__()
        self.model, self.host, self.device, self.calls = model, host, device, 0
        self.stall_at, self.stall_s, self.stall_in_op = stall_at, stall_s, stall_in_op

    def forward(self, inputs):
        self.calls += 1
        stall = self.stall_s if self.calls == self.stall_at else 0.0
        measure_clock.now.advance(self.host + (0.0 if self.stall_in_op else stall))
        inputs = takes(inputs, self.device + (stall if self.stall_in_op else 0.0))
        return self.model(inputs)


class Slow(Dataset):
    """Each sample takes ``seconds`` of the step clock to build."""

    def __init__(self, clock, seconds=0.003):
        self.clock, self.seconds = clock, seconds

    def __len__(self):
        return 64

    def __getitem__(self, index):
        self.clock.advance(self.seconds)
        return torch.ones(4), 0


def train(model, batches, steps=STEPS):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _, (inputs, labels) in zip(range(steps), batches):
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad()


def endless(make):
    while True:
        yield make()


def profile_row():
    return autogaudi.report().unit("step_profiler")


def small_batches():
    return endless(lambda: (torch.randn(4, 8), torch.randint(0, 3, (4,))))


def test_a_step_whose_ops_compute_little_of_it_is_host_bound(step_clock):
    autogaudi.enable(device="cpu", only="step_profiler")
    train(Timed(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)), host=0.010), small_batches())
    figures = profile_row()["figures"]
    assert figures["bound"] == "host", profile_row()
    assert (figures["ms_per_step"], figures["compute_fraction"], figures["input_wait_fraction"]) == (10.0, 0.0, 0.0)
    assert figures["ops_per_step"] > 10


class SlowerUnderTheCensus(Timed):
    """Each call under the census's dispatch mode takes ``extra`` seconds more: the profiler's work."""

    def __init__(self, model, host, extra):
        super().__init__(model, host=host)
        self.extra = extra

    def forward(self, inputs):
        if _get_current_dispatch_mode() is not None:
            measure_clock.now.advance(self.extra)
        return super().forward(inputs)


def test_what_the_census_steps_took_beyond_the_clean_ones_is_autogaudis_cost_in_the_report(step_clock):
    autogaudi.enable(device="cpu", only="step_profiler")
    train(
        SlowerUnderTheCensus(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)), 0.010, 0.004), small_batches()
    )
    extra = profile_row()["figures"]["census_extra_s"]
    assert round(extra / 0.004) in range(DECIDING_PAIRS, PAIRS + 1) and extra == pytest.approx(
        0.004 * round(extra / 0.004)
    )
    whole = autogaudi.report().as_dict()["summary"]["whole_run"]
    assert whole["measuring_s"] == extra  # the rest of the cost is autogaudi's start and per-call work
    assert whole["cost_s"] == pytest.approx(extra + whole["start_up_s"] + whole["per_call_s"], abs=0.002)


def test_census_steps_no_slower_than_the_clean_ones_cost_nothing():
    clean = [(0.010, 0.0), (0.012, 0.0), (0.011, 0.0)]
    assert classification.census_extra_s(clean, []) == 0.0
    assert classification.census_extra_s(clean, [0.009, 0.011]) == 0.0
    assert classification.census_extra_s(clean, [0.013, 0.015]) == pytest.approx(0.006)


@pytest.mark.parametrize("steps_left", [None, 1000])
def test_a_census_with_a_one_off_waits_until_the_run_can_carry_it(step_clock, monkeypatch, steps_left):
    """A one-off of 1 s is carried by a run of 20 s (5%): at 0.5 s a step, the census starts at step 40;
    where a framework says 1000 steps are left, the run is long enough as soon as one timed step gives
    the pace (the step after warm-up)."""
    from autogaudi.backends.cpu import CpuBackend
    from autogaudi.optimizations import step_profiler

    monkeypatch.setattr(CpuBackend, "census_one_off_s", 1.0)
    monkeypatch.setattr(step_profiler.unit.run_length, "remaining_steps", lambda: steps_left and (steps_left, "test"))
    autogaudi.enable(device="cpu", only="step_profiler")
    model = Timed(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)), host=0.5)
    batches = small_batches()
    train(model, batches, steps=30)
    row = profile_row()
    if steps_left is None:
        assert (row["status"], row["reason_code"]) == ("deciding", "census_waits")
        assert row["reason_params"] == {"one_off_s": 1.0, "backend": "cpu", "after_s": 20.0}
        train(model, batches, steps=30)
    first = 40 if steps_left is None else 4
    assert profile_row()["figures"]["profiled_at_step"] == first + 2 * DECIDING_PAIRS
    assert profile_row()["figures"]["bound"] == "host"


@pytest.mark.parametrize("asked", [{"force": "graph_capture"}, {"trial": "channels_last"}, {"ranks": 2}])
def test_a_forced_unit_a_trial_or_several_ranks_take_the_census_one_off_at_once(step_clock, monkeypatch, asked):
    """The user takes the one-offs of what they forced or put on trial; ranks must all start the census
    at the same step, which their own clocks would not give."""
    from autogaudi.backends.cpu import CpuBackend
    from autogaudi.optimizations import step_profiler

    monkeypatch.setattr(CpuBackend, "census_one_off_s", 1.0)
    several = asked.pop("ranks", 1) > 1
    monkeypatch.setattr(step_profiler.unit, "several_ranks", lambda: several)
    monkeypatch.setattr(step_profiler.unit, "rank_zero_choice", lambda value: value)
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture,channels_last", **asked)
    model = Timed(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)), host=0.5)
    train(model, small_batches(), steps=STEPS)
    # pairs that read alike settle it early on one process; ranks take every pair (the same steps on each)
    assert profile_row()["figures"]["profiled_at_step"] == 3 + 2 * (PAIRS if several else DECIDING_PAIRS)


def test_the_census_waits_for_another_units_timing_but_not_for_an_optimizer_that_stopped_stepping(step_clock):
    """The census starts once fused_optimizer's update is decided and its hold on the steps released;
    an optimizer stepped twice and then never again (its update never decided) holds it back no more
    than STALE_STEPS after the unit's last timed update."""
    from autogaudi.measure import trials
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer

    autogaudi.enable(device="cpu", only="step_profiler,fused_optimizer", trial="fused_optimizer")
    model = Timed(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)), host=0.010)
    main = torch.optim.AdamW(model.parameters())
    for stepped_twice in (False, True):
        idle_model = nn.Linear(2, 2)
        idle = torch.optim.AdamW(idle_model.parameters())
        seen = []
        for step, (inputs, labels) in zip(range(80), small_batches()):
            nn.functional.cross_entropy(model(inputs), labels).backward()
            main.step()
            main.zero_grad()
            if stepped_twice and step < 2:
                idle_model(torch.ones(1, 2)).sum().backward()
                idle.step()
            seen.append(profile_row()["reason_code"])
        started = profile_row()["figures"]["profiled_at_step"] - 2 * DECIDING_PAIRS
        decided = 1 + fused_optimizer.TIMED_STEPS  # the main optimizer's update decided
        assert "others_measuring" in seen
        if stepped_twice:  # held back by the undecided optimizer, until its hold went stale
            assert decided < started <= decided + trials.STALE_STEPS, seen
        else:
            assert started == decided, seen
        autogaudi.disable()
        autogaudi.enable(device="cpu", only="step_profiler,fused_optimizer", trial="fused_optimizer")


def test_a_step_whose_ops_compute_most_of_it_is_device_bound(step_clock):
    autogaudi.enable(device="cpu", only="step_profiler")
    train(Timed(nn.Linear(8, 3), host=0.002, device=0.008), small_batches())
    figures = profile_row()["figures"]
    assert figures["bound"] == "device" and figures["compute_fraction"] == 0.8, profile_row()
    assert figures["compute_fraction_range"] == [0.8, 0.8]


def test_large_matrix_products_are_device_bound():
    """On real time (the census's clock around real kernels): a machine's load only adds to them."""
    autogaudi.enable(device="cpu", only="step_profiler")
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 3))
    train(model, endless(lambda: (torch.randn(512, 1024), torch.randint(0, 3, (512,)))))
    figures = profile_row()["figures"]
    assert figures["bound"] == "device", profile_row()
    assert figures["compute_fraction"] >= 0.5 and figures["model"] == "Sequential"
    low, high = figures["compute_fraction_range"]
    assert low <= figures["compute_fraction"] <= high


def test_one_stalled_clean_step_leaves_a_device_bound_run_device_bound(step_clock):
    """A mean over the clean steps would read the 0.5 s stall as host time in every step."""
    autogaudi.enable(device="cpu", only="step_profiler")
    model = Timed(nn.Linear(8, 3), host=0.002, device=0.008, stall_at=3 + 1, stall_s=0.5)  # the first clean step
    train(model, small_batches())
    figures = profile_row()["figures"]
    assert figures["bound"] == "device" and figures["compute_fraction_range"][0] < 0.1, profile_row()


def test_one_stalled_census_step_leaves_a_host_bound_run_host_bound(step_clock):
    """One census step whose op stalls 0.3 s reads as all compute; the other census steps outvote it."""
    autogaudi.enable(device="cpu", only="step_profiler")
    model = Timed(nn.Linear(8, 3), host=0.010, stall_at=3 + 2, stall_s=0.3, stall_in_op=True)  # the first census
    train(model, small_batches())
    figures = profile_row()["figures"]
    assert figures["bound"] == "host", profile_row()
    assert figures["compute_fraction_range"] == [0.0, 1.0]  # the stalled step was seen, and outvoted
    assert figures["profiled_at_step"] == 3 + 2 * PAIRS  # pairs that disagree: every pair is taken


def test_a_slow_dataset_is_input_bound(step_clock):
    autogaudi.enable(device="cpu", only="step_profiler")
    train(Timed(nn.Linear(4, 2), host=0.004), iter(DataLoader(Slow(step_clock), batch_size=4)))
    figures = profile_row()["figures"]
    assert figures["bound"] == "input" and figures["input_wait_fraction"] == 0.75, profile_row()


def test_a_loop_with_two_optimizers_is_measured_by_whole_iterations():
    """A GAN-shaped loop: a tiny model's step, then a large one's. Counted per optimizer step, the
    clean step would be the large model's half and the census the tiny one's: host-bound, wrongly."""
    autogaudi.enable(device="cpu", only="step_profiler")
    tiny, large = nn.Linear(8, 3), nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 3))
    optimizers = [torch.optim.SGD(model.parameters(), lr=1e-3) for model in (tiny, large)]
    for _ in range(STEPS):
        for model, optimizer, width, batch in zip((tiny, large), optimizers, (8, 1024), (4, 512)):
            nn.functional.cross_entropy(model(torch.randn(batch, width)), torch.randint(0, 3, (batch,))).backward()
            optimizer.step()
            optimizer.zero_grad()
    assert profile_row()["figures"]["bound"] == "device", profile_row()


@pytest.mark.parametrize("device_seconds,bound", [(0.05, "device"), (0.0, "host")])
def test_hpu_device_time_comes_from_the_synchronize_wait(hpu_double, step_clock, device_seconds, bound):
    calls = hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="step_profiler")
    calls.DEVICE_SECONDS[0], calls.WAIT[0] = device_seconds, step_clock.advance
    model = Timed(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)), host=0.01)
    train(model, endless(lambda: (torch.randn(8, 16), torch.randint(0, 3, (8,)))))
    assert profile_row()["figures"]["bound"] == bound, profile_row()
    # each census step starts on an idle device and ends with a flush and a wait; no other step waits.
    # In lazy mode the bridge's synchronize marks a step itself before waiting.
    synchronize = ["mark_step", "synchronize"]
    assert calls.names() == [*synchronize, "mark_step", *synchronize] * DECIDING_PAIRS


def train_reading_the_loss(model, batches, autocast=False):
    """A loop that reads its loss every step (``.item()``), as most scripts print or log it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    seen = []
    for _, (inputs, labels) in zip(range(STEPS), batches):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seen.append(loss.item())  # READS THE LOSS
    return seen


READ_LINE = next(number for number, line in enumerate(open(__file__), 1) if line.rstrip().endswith("# READS THE LOSS"))


def test_host_reads_and_matrix_dtypes_are_measured_but_cost_nothing_on_the_cpu():
    """The CPU runs each op as it is issued: a read waits for nothing, and bf16 was measured slower
    here; the figures are there, the recommendations are not."""
    autogaudi.enable(device="cpu", only="step_profiler")
    train_reading_the_loss(nn.Linear(16, 3), endless(lambda: (torch.randn(8, 16), torch.randint(0, 3, (8,)))))
    row = profile_row()
    assert row["figures"]["host_reads_per_step"] == 1, row
    assert row["figures"]["host_read_sites"] == [f"tests/optimizations/test_step_profiler.py:{READ_LINE} (1/step)"]
    assert row["figures"]["fp32_matrix_fraction"] == 1.0 and row["recommendations"] == [], row


@pytest.mark.parametrize("autocast", [False, True])
def test_on_a_device_that_runs_ahead_reads_and_fp32_products_are_recommended_against(hpu_double, step_clock, autocast):
    calls = hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="step_profiler")
    calls.DEVICE_SECONDS[0], calls.WAIT[0] = 0.05, step_clock.advance  # device-bound: 50 ms against 10
    model = Timed(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)), host=0.01)
    train_reading_the_loss(model, endless(lambda: (torch.randn(8, 16), torch.randint(0, 3, (8,)))), autocast)
    row = profile_row()
    assert row["figures"]["bound"] == "device", row
    (reads, params), *precision = said(row, "recommendation")
    site = f"tests/optimizations/test_step_profiler.py:{READ_LINE} (1/step)"
    assert (reads, params) == ("host_reads", {"per_step": 1, "sites": site}), params
    assert f"test_step_profiler.py:{READ_LINE}" in row["recommendations"][0]["do"]
    # a script that already runs its products in bf16 is not told to
    assert row["figures"]["fp32_matrix_fraction"] == (0.0 if autocast else 1.0), row
    assert precision == ([] if autocast else [("fp32_products", {"share": 1.0, "device": "hpu"})]), precision
    advice = row["recommendations"][1:]
    assert all(0 < item["saves"] <= 0.5 and item["saves_basis"] == "estimated" for item in advice), advice


class PassThrough(TorchDispatchMode):
    """A mode of the script's own, around its whole loop."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_a_census_step_that_fails_to_stop_is_reverted_once_and_the_scripts_mode_survives(hpu_double, monkeypatch):
    calls = hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="step_profiler")
    hpu = importlib.import_module("habana_frameworks.torch.hpu")
    waits = []

    def synchronize():
        waits.append(1)
        if len(waits) == 2:  # the first census step's closing wait
            raise RuntimeError("device lost")

    monkeypatch.setattr(hpu, "synchronize", synchronize)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    with PassThrough() as mode:
        train(model, endless(lambda: (torch.randn(8, 16), torch.randint(0, 3, (8,)))))
        assert _get_current_dispatch_mode() is mode
    assert _get_current_dispatch_mode() is None
    row = profile_row()
    assert (row["status"], row["reason_code"]) == ("failed", "failed_at_run_time"), row
    assert "device lost" in row["reason_params"]["error"]
    assert "revert_raised" not in row["note_codes"], row  # the census mode left once
    assert calls.names().count("mark_step") == 1 and len(waits) == 2  # reverted: no further census steps


def test_the_training_model_is_the_module_inside_ddp(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        autogaudi.enable(device="cpu", only="step_profiler")
        inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        model = nn.parallel.DistributedDataParallel(inner)
        train(model, endless(lambda: (torch.randn(4, 8), torch.randint(0, 3, (4,)))))
        profiler = runtime._STATE.session.unit("step_profiler")
        assert profiler.profile.model is inner
    finally:
        autogaudi.disable()
        dist.destroy_process_group()


class Scaled(nn.Sequential):
    """A Sequential of no layers with a weight of its own: a module whose truth is its length, 0."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8, 3))

    def forward(self, inputs):
        return inputs @ self.weight


def test_the_training_model_is_found_whatever_its_length():
    """The root module is tested against None: an empty Sequential is false, and was profiled as
    called in no step."""
    autogaudi.enable(device="cpu", only="step_profiler")
    model = Scaled()
    train(model, small_batches())
    row = profile_row()
    assert row["status"] == "watching" and row["reason_code"].endswith("_bound"), row
    assert (row["figures"]["model"], row["figures"]["model_calls_per_step"]) == ("Scaled", 1)
    assert runtime._STATE.session.unit("step_profiler").profile.model is model


class Net(nn.Module):
    """A custom module: no ``__len__``, which torch.compile's OptimizedModule forwards ``len()`` to."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, inputs):
        return self.layers(inputs)


def test_a_model_the_script_compiled_is_profiled_and_torch_warns_nothing():
    """``torch.compile(model)`` of a custom module: the profile names the compiled class and keeps the
    ``OptimizedModule`` the script calls as its model (the units that would compile it see it compiled
    already). While the census's global hooks exist the compiled module's calls carry them as its own:
    torch's warning about global hooks with torch.compile(module) is not raised, and after disable()
    ``OptimizedModule.__call__`` and torch's global hooks are as they were."""
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.nn.modules import module as torch_module

    call = vars(OptimizedModule)["__call__"]
    autogaudi.enable(device="cpu", only="step_profiler")
    model = torch.compile(Net(), backend="eager")
    try:
        gc.collect()  # earlier tests' garbage warns as it is collected ("Implicitly cleaning up"): not here
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(model, small_batches())
        assert [str(warning.message) for warning in caught] == []
        row = profile_row()
        assert row["status"] == "watching" and row["reason_code"].endswith("_bound"), row
        assert (row["figures"]["model"], row["figures"]["model_calls_per_step"]) == ("Net", 1)
        assert runtime._STATE.session.unit("step_profiler").profile.model is model
        autogaudi.disable()
        assert vars(OptimizedModule)["__call__"] is call
        assert not torch_module._global_forward_pre_hooks and not torch_module._global_forward_hooks
        assert not model._forward_pre_hooks and not model._forward_hooks  # nothing left on the script's module
    finally:
        torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_a_nanogpt_shaped_script_that_compiles_its_model_runs_as_plain_and_is_profiled(tmp_path, backend):
    """nanoGPT's defaults: ``torch.compile(model)`` of its own module, evaluated under no_grad, trained
    with AdamW. Under ``-m autogaudi --quiet`` the output is plain's, byte for byte (torch's warning
    about global hooks with torch.compile(module) included: none), and the step profile is there."""
    script, report = SCRIPTS / "compiled_gpt.py", tmp_path / "report.json"
    env = clean_env(BACKEND=backend)
    plain = run_python(script, env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    mine = run_python("-m", "autogaudi", "--quiet", "--report", report, script, env=env)
    assert (mine.returncode, mine.stdout, mine.stderr) == (plain.returncode, plain.stdout, plain.stderr)
    row = next(unit for unit in json.loads(report.read_text())["units"] if unit["name"] == "step_profiler")
    assert row["status"] == "watching" and row["reason_code"].endswith("_bound"), row
    assert row["figures"]["model"] == "GPT" and row["figures"]["ops_per_step"] > 0, row["figures"]


@pytest.mark.slow
def test_ranks_that_measure_apart_follow_rank_zero_and_finish_the_trial_together(tmp_path):
    """Rank 1 waits for slow data (input-bound), rank 0 does not (host-bound): were each to act on
    its own profile, rank 0 would run a compile trial whose decision it broadcasts while rank 1 sits
    in DDP's all-reduce, and the job would hang (run_python's timeout fails the test then)."""
    # Rank 0's Python (45 ms) outlasts rank 1's wait for data (30 ms) by a third of its step, more than
    # a loaded machine's scheduling shifts either, so that rank 0 does not wait for rank 1 in the
    # all-reduce (it would read communication-bound or unclear, and start no trial); rank 1's wait is
    # still about two thirds of its step (input-bound from half).
    env = {
        "AUTOGAUDI": "1",
        "AUTOGAUDI_QUIET": "1",
        "AUTOGAUDI_TRIAL": "graph_capture",  # asked for: a trial that changes the numbers runs only so
        "STEPS": "70",  # the profile, then the trial's 30 steps (its blocks and warm-up) with room to spare
        "SLOW_DATA_RANK": "1",
        "SLOW_DATA_MS": "30",
        "SLOW_HOST_RANK": "0",
        "SLOW_HOST_MS": "45",
    }
    result, workers = torchrun(tmp_path, *TORCHRUN, SCRIPTS / "ddp_train.py", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    profiles = [worker["units"]["step_profiler"] for worker in workers]
    assert profiles[0]["figures"]["bound"] == profiles[1]["figures"]["bound"] == "host"
    # Rank 1 measured apart (input-bound on a quiet machine; beside other work its waits can read
    # unclear) and followed rank 0: what keeps the ranks in step is that it followed, not what it read.
    followed = [params["bound"] for code, params in said(profiles[1]) if code == "follows_rank_zero"]
    assert followed and followed[0] in ("input", "unclear"), profiles[1]
    captures = [worker["units"]["graph_capture"]["reason_code"] for worker in workers]
    assert captures[0] == captures[1] and captures[0] != "trial_running"  # decided alike, no trial left running
    assert workers[0]["checksum"] == workers[1]["checksum"]


@pytest.mark.slow
def test_a_rank_that_waits_for_a_slower_ranks_all_reduce_is_communication_bound(tmp_path):
    """Rank 1 spends 60 ms of Python before each step; rank 0, with the same tiny model, waits for it
    in DDP's all-reduce. That wait is neither ops nor issuing them: counted as host time, it made
    rank 0 read host-bound, and both ranks ran a compile trial that could not help. Its 60 ms
    keep rank 0's wait well over half of its step whatever a loaded machine adds to rank 0's own."""
    env = {"AUTOGAUDI": "1", "AUTOGAUDI_QUIET": "1", "STEPS": "40", "SLOW_HOST_RANK": "1", "SLOW_HOST_MS": "60"}
    result, workers = torchrun(tmp_path, *TORCHRUN, SCRIPTS / "ddp_train.py", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    profiles = [worker["units"]["step_profiler"] for worker in workers]
    figures = profiles[0]["figures"]
    # Its ops and waits together sit near the host-bound line: on a loaded machine (this suite beside
    # two ranks) within the census's noise band, so unclear; never host-bound.
    bound = figures["bound"]
    assert bound in ("communication", "unclear") and figures["collective_wait_fraction"] >= 0.5, figures
    # Rank 1 mostly measures itself host-bound (its 20 ms of Python), but it too can wait for rank 0's
    # slower census steps; whatever it measured, it follows rank 0.
    assert profiles[1]["figures"]["bound"] == bound, (profiles[1]["figures"], profiles[1]["notes"])
    for worker in workers:
        row = worker["units"]["graph_capture"]
        assert (row["reason_code"], row["reason_params"]["bound"]) == ("not_host_bound", bound)


CENSUS_WITHOUT_DYNAMO = """
import sys
import torch
import autogaudi
from autogaudi.optimizations.step_profiler import census
autogaudi.enable(device="cpu", only="step_profiler", quiet=True)
if sys.argv[1] == "compiled":
    import torch._dynamo  # what any torch.compile of the script's does
kinds = []
real = census.new_census
census.new_census = lambda: kinds.append(type(real()).__name__) or real()
model = torch.nn.Linear(8, 2)
for _ in range(40):  # parameters updated by hand: torch.optim's constructor would import dynamo itself
    model(torch.randn(4, 8)).sum().backward()
    with torch.no_grad():
        for param in model.parameters():
            param -= 0.1 * param.grad
            param.grad = None
assert autogaudi.report().unit("step_profiler")["figures"]["bound"]
print(sorted(set(kinds)), "torch._dynamo" in sys.modules)
"""


@pytest.mark.parametrize(
    "script, expected",
    [("plain", "['_Census'] False"), ("compiled", "['_DynamoSafeCensus'] True")],
)
def test_the_census_does_not_load_dynamo_and_keeps_out_of_it_once_loaded(tmp_path, script, expected):
    """Entering a dispatch mode whose handler torch wrapped in dynamo.disable imports torch._dynamo:
    1 s of a 1.5 s corpus script's run (one without torch.optim, whose constructor loads dynamo
    anyway). Where nothing loaded dynamo the census leaves it unloaded."""
    path = tmp_path / "census.py"
    path.write_text(CENSUS_WITHOUT_DYNAMO)
    result = run_python(path, script)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == expected


def gloo_pair(tmp_path) -> list:
    """Two gloo ranks in this process (one per thread), through the dispatcher's c10d ops as
    torch.distributed's own calls go."""
    store = dist.FileStore(str(tmp_path / "store"), 2)
    groups = [None, None]

    def join(rank):
        group = dist.ProcessGroup(store, rank, 2)
        group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        gloo = dist.ProcessGroupGloo(store, rank, 2)
        group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        groups[rank] = group

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return groups


def test_a_collective_whose_work_has_no_future_is_counted_and_its_wait_measured(tmp_path):
    """gloo's reduce-scatter (FSDP2's gradient reduction) hands back a Work without a future: asking
    for one raised inside the user's backward. Its caller waits at once; the time off the CPU until
    the next op is the wait for the other rank, here 0.1 s late: late from the moment this rank is
    about to issue its own, so that however long a loaded machine takes to get here, the wait is
    real time no shorter than about 0.1 s (asserted: half of it)."""
    groups = gloo_pair(tmp_path)
    issuing = threading.Event()

    def late_rank():
        issuing.wait(60)
        time.sleep(0.1)
        groups[1]._reduce_scatter_base(torch.empty(2), torch.ones(4)).wait()

    peer = threading.Thread(target=late_rank)
    peer.start()
    census = new_census()
    with census:
        issuing.set()
        groups[0]._reduce_scatter_base(torch.empty(2), torch.ones(4)).wait()
        torch.add(torch.ones(1), torch.ones(1))
    peer.join(timeout=60)
    assert (census.collectives, census.without_future) == (1, 1)
    assert census.collective_seconds >= 0.05, census.collective_seconds


@pytest.mark.slow
def test_fsdp2_with_a_dcp_checkpoint_trains_under_autogaudi_as_plain(tmp_path):
    """FSDP2 on two gloo ranks (fully_shard per block, prefetching, gradient sync off for the first
    micro-batch, clipping), saved with torch.distributed.checkpoint, loaded into a fresh model and
    trained on: the same losses and weights as plain, a full state dict plain torch loads alike, and
    a profile that counts the reduce-scatters whose Work has no future."""
    script = SCRIPTS / "fsdp2_train.py"
    result, plain = torchrun(tmp_path, *PLAIN_TORCHRUN, script)
    assert result.returncode == 0, result.stderr[-3000:]
    result, mine = torchrun(tmp_path, *TORCHRUN, script, env={"AUTOGAUDI": "1", "AUTOGAUDI_QUIET": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert [worker["rank"] for worker in mine] == [0, 1] and all(worker["autogaudi"] for worker in mine)
    for worker, reference in zip(mine, plain):
        assert worker["saved"] == worker["reloaded"]  # DCP restored every weight into the fresh model
        torch.testing.assert_close(worker["losses"], reference["losses"], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(worker["checksum"], reference["checksum"], rtol=1e-4, atol=1e-6)
        row = worker["units"]["step_profiler"]
        assert row["status"] != "failed", row
        assert row["figures"]["collectives_without_future_per_step"] >= 1, row["figures"]
        assert "collective_wait_fraction" in row["figures"], row["figures"]
    plain_run, my_run = tmp_path / "run0", tmp_path / "run1"  # torchrun() names each job's folder in turn
    full, plain_full = (torch.load(run / "full.pt", weights_only=True) for run in (my_run, plain_run))
    assert full.keys() == plain_full.keys()
    for name, tensor in full.items():
        torch.testing.assert_close(tensor, plain_full[name], rtol=1e-4, atol=1e-6)
    # The DCP checkpoint, read without a process group: plain's weights, optimizer state and settings
    # (fused_optimizer's fused=True is not in it).
    for run in (plain_run, my_run):
        dcp_to_torch_save(run / "dcp", run / "dcp.pt")
    mine_dcp, plain_dcp = (torch.load(run / "dcp.pt", weights_only=False) for run in (my_run, plain_run))
    assert mine_dcp["optim"]["param_groups"] == plain_dcp["optim"]["param_groups"]
    torch.testing.assert_close(mine_dcp["model"], plain_dcp["model"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(mine_dcp["optim"]["state"], plain_dcp["optim"]["state"], rtol=1e-4, atol=1e-6)
