"""pin_memory: loaders without a choice are pinned when an accelerator is the target (HPU double);
the script's own choice is kept; CPU-only runs are skipped."""

import warnings

import torch
from torch.utils.data import DataLoader, TensorDataset

import autogaudi

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
    assert autogaudi.report().unit("pin_memory")["figures"] == {"loaders_pinned": 2}


def test_skipped_on_cpu():
    autogaudi.enable(device="cpu")
    row = autogaudi.report().unit("pin_memory")
    assert (row["status"], row["reason_code"]) == ("skipped", "other_backend")
    assert DataLoader(DATA).pin_memory is False
