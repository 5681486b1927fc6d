"""static_last_batch against the HPU double (lazy): every batch full, every sample still seen,
the plain order kept for the original samples, and the alternatives and exclusions."""

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler, TensorDataset

import autogaudi

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


def test_skipped_on_cpu_and_in_eager_mode(hpu_double):
    autogaudi.enable(device="cpu")
    assert autogaudi.report().unit("static_last_batch")["reason_code"] == "other_backend"
    autogaudi.disable()
    hpu_double(lazy=False)
    autogaudi.enable(device="hpu")
    assert autogaudi.report().unit("static_last_batch")["reason_code"] == "hpu_eager"
