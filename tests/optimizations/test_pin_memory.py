"""pin_memory: loaders without a choice are pinned when an accelerator is the target (HPU double),
with the arguments under which the installed DataLoader pins for that device, found by asking it:
checked on this torch's DataLoader (pins for the current accelerator) and on one that pins for CUDA
unless the device is named, as torch's did before it pinned for the accelerator. The script's own
choice is kept; CPU-only runs are skipped."""

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset, dataloader

import autogaudi
from autogaudi.optimizations import pin_memory

DATA = TensorDataset(torch.arange(6.0))


def test_pinned_for_the_accelerator_unless_the_script_chose(hpu_double):
    hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="pin_memory")
    assert DataLoader(DATA, batch_size=2).pin_memory is True
    assert DataLoader(DATA, batch_size=2, pin_memory=False).pin_memory is False
    assert DataLoader(DATA, 2, False, None, None, 0, None, False).pin_memory is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # this CPU-only torch cannot pin: it warns and goes on
        assert [b[0].tolist() for b in DataLoader(DATA, batch_size=3)] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    row = autogaudi.report().unit("pin_memory")
    assert row["figures"] == {"loaders_pinned": 2}
    assert row["note_codes"] == ["pins_nothing_here"]  # no accelerator here: the double's hpu is the CPU


@pytest.fixture
def hpu_is_the_accelerator(monkeypatch):
    """torch.accelerator answering as on a Gaudi whose bridge registered hpu (nothing is pinned: the
    tests read what the iterators would pin for)."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("hpu"))


@pytest.fixture
def loader_pinning_for_cuda_unless_named(monkeypatch):
    """The iterator's pinning decision as torch's DataLoader made it before it pinned for the current
    accelerator (through torch 2.7, where torch.accelerator already exists): the named
    ``pin_memory_device``, else CUDA where it is available."""
    original = dataloader._BaseDataLoaderIter.__init__

    def init(self, loader):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            original(self, loader)
        if loader.pin_memory_device:
            self._pin_memory, self._pin_memory_device = loader.pin_memory, loader.pin_memory_device
        else:
            self._pin_memory, self._pin_memory_device = loader.pin_memory and torch.cuda.is_available(), None

    monkeypatch.setattr(dataloader._BaseDataLoaderIter, "__init__", init)


def pins_for(loader) -> str | None:
    """The device the loader's iterators pin its batches for, None where they pin nothing."""
    iterator = iter(loader)
    return (iterator._pin_memory_device or "cuda") if iterator._pin_memory else None


def pinned_loader(hpu_double):
    hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="pin_memory")
    return DataLoader(DATA, batch_size=2)


def test_a_loader_that_pins_for_the_current_accelerator_gets_no_device_named(hpu_double, hpu_is_the_accelerator):
    loader = pinned_loader(hpu_double)
    assert loader.pin_memory_device == "" and pins_for(loader) == "hpu"  # not named: deprecated there
    assert pin_memory.pinning_arguments("hpu") == {}
    assert autogaudi.report().unit("pin_memory")["note_codes"] == []


def test_a_loader_that_pins_for_cuda_unless_named_is_told_hpu_though_torch_accelerator_exists(
    hpu_double, hpu_is_the_accelerator, loader_pinning_for_cuda_unless_named
):
    assert hasattr(torch, "accelerator")
    loader = pinned_loader(hpu_double)
    assert pins_for(loader) == "hpu"
    assert pin_memory.pinning_arguments("hpu") == {"pin_memory_device": "hpu"}


def test_the_probe_draws_nothing_from_the_scripts_random_stream():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    pin_memory.pinning_arguments("hpu")
    assert torch.equal(torch.rand(3), expected)


def test_skipped_on_cpu():
    autogaudi.enable(device="cpu")
    row = autogaudi.report().unit("pin_memory")
    assert (row["status"], row["reason_code"]) == ("skipped", "other_backend")
    assert DataLoader(DATA).pin_memory is False
