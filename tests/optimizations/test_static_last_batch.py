"""static_last_batch against the HPU double (lazy): every batch full, every sample still seen,
the plain order kept for the original samples, and the alternatives and exclusions; on the CPU, the
short batch filled where graph capture makes shapes matter, and left alone on an eager run."""

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

import autogaudi
from autogaudi.backends.cpu import CpuBackend
from tests.optimizations.test_step_profiler import STEPS

DATA = TensorDataset(torch.arange(10))


def epochs(make, count=2):
    torch.manual_seed(0)
    loader = make()
    return [[batch[0].tolist() for batch in loader] for _ in range(count)]


@pytest.fixture
def lazy(hpu_double):
    hpu_double(lazy=True)


def test_repeat_pads_each_epoch_with_its_own_first_samples(lazy):
    make = lambda: DataLoader(DATA, batch_size=4, shuffle=True)  # noqa: E731
    plain = epochs(make)
    autogaudi.enable(device="hpu", only="static_last_batch")
    padded = epochs(make)
    for before, after in zip(plain, padded):
        flat_before = [i for batch in before for i in batch]
        flat_after = [i for batch in after for i in batch]
        assert [len(batch) for batch in after] == [4, 4, 4]
        assert flat_after[:10] == flat_before  # the same shuffle as the plain run
        assert flat_after[10:] == flat_before[:2]  # padded from the epoch's own start
    row = autogaudi.report().unit("static_last_batch")
    assert row["figures"] == {"loaders_padded": 1, "samples_added_per_epoch": 2}
    assert row["note_codes"] == ["repeats_samples"]


def test_drop_policy_and_positional_calls(lazy):
    autogaudi.enable(device="hpu", only="static_last_batch", last_batch="drop")
    assert [len(b) for b in epochs(lambda: DataLoader(DATA, 4, False))[0]] == [4, 4]
    assert autogaudi.report().unit("static_last_batch")["figures"]["samples_added_per_epoch"] == -2


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(DATA, batch_size=4, drop_last=True),
        lambda: DataLoader(DATA, batch_sampler=BatchSampler(SequentialSampler(DATA), 4, False)),
        lambda: DataLoader(DATA, batch_size=5),
        lambda: DataLoader(DATA, batch_size=None),
        lambda: DataLoader(DATA, batch_size=4, sampler=DistributedSampler(DATA, num_replicas=2, rank=0)),
    ],
    ids=["drop_last", "batch_sampler", "divides_evenly", "no_batching", "own_sampler"],
)
def test_loaders_it_leaves_alone(lazy, make):
    plain = epochs(make)
    autogaudi.enable(device="hpu", only="static_last_batch")
    assert epochs(make) == plain
    assert autogaudi.report().unit("static_last_batch")["figures"]["loaders_padded"] == 0


def test_eager_runs_pad_nothing(hpu_double):
    autogaudi.enable(device="cpu", only="step_profiler,static_last_batch")
    assert trained_batch_sizes()[-1] == 4
    assert autogaudi.report().unit("static_last_batch")["reason_code"] == "eager"
    autogaudi.disable()
    hpu_double(lazy=False)
    autogaudi.enable(device="hpu", only="step_profiler,static_last_batch")
    assert trained_batch_sizes()[-1] == 4
    row = autogaudi.report().unit("static_last_batch")
    assert row["reason_code"] == "hpu_eager" and row["figures"]["loaders_padded"] == 0


def trained_batch_sizes() -> list:
    """Two epochs of a loader whose last batch is short (4 of 8), a training step per batch."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8 * STEPS + 4, 4)), batch_size=8, shuffle=True)
    sizes = []
    for _ in range(2):
        for (inputs,) in loader:
            model(inputs).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            sizes.append(len(inputs))
    return sizes


def test_where_graph_capture_makes_shapes_matter_the_short_batch_is_filled(monkeypatch):
    monkeypatch.setattr(CpuBackend, "graph_forward", lambda self, module, **kwargs: module._call_impl)
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture,static_last_batch", force="graph_capture")
    sizes = trained_batch_sizes()
    assert sizes == [8] * len(sizes)  # the profile comes before the first epoch's end
    row = autogaudi.report().unit("static_last_batch")
    assert row["reason_code"] == "policy" and row["status"] == "applied"
    assert row["figures"] == {"loaders_padded": 1, "samples_added_per_epoch": 4}
