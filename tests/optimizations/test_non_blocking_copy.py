"""non_blocking_copy: which calls become asynchronous. No accelerator exists here, so the decision is
tested on real CPU tensors (a CPU-only torch cannot pin memory: is_pinned() is genuinely False),
and the unit's application per backend; the copy itself is verified on a GPU when one is lent."""

import pytest
import torch

import autogaudi
from autogaudi.optimizations.non_blocking_copy import target_device_type, wants_non_blocking


@pytest.mark.parametrize(
    "args, kwargs, expected",
    [
        (("cuda",), {}, "cuda"),
        (("cuda:1",), {}, "cuda"),
        ((torch.device("hpu"),), {}, "hpu"),
        ((), {"device": "hpu"}, "hpu"),
        ((torch.float16,), {}, None),
        ((torch.ones(1),), {}, None),
        ((0,), {}, None),
    ],
)
def test_target_device_type(args, kwargs, expected):
    assert target_device_type(args, kwargs) == expected


class Pinned(torch.Tensor):
    """A CPU tensor that reports itself pinned, standing in for DataLoader(pin_memory=True) output."""

    def is_pinned(self, device=None):
        return True


def test_only_pinned_host_to_accelerator_copies_without_a_choice_become_non_blocking():
    pinned = torch.ones(2).as_subclass(Pinned)
    assert wants_non_blocking(pinned, ("cuda",), {}, "cuda")
    assert wants_non_blocking(pinned, ("cuda", torch.float16), {}, "cuda")
    assert not wants_non_blocking(pinned, ("cuda",), {"non_blocking": False}, "cuda")  # the script chose
    assert not wants_non_blocking(pinned, ("cuda", torch.float16, False), {}, "cuda")
    assert not wants_non_blocking(pinned, ("cpu",), {}, "cuda")  # never device-to-host or host-to-host
    assert not wants_non_blocking(torch.ones(2), ("cuda",), {}, "cuda")  # pageable memory: no gain, keep it
    assert not torch.ones(2).is_pinned()


def test_skipped_on_cpu_and_reverted_exactly(hpu_double):
    original = torch.Tensor.to
    autogaudi.enable(device="cpu")
    row = autogaudi.report().unit("non_blocking_copy")
    assert (row["status"], row["reason_code"]) == ("skipped", "other_backend")
    autogaudi.disable()
    hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="non_blocking_copy")
    assert autogaudi.report().unit("non_blocking_copy")["status"] == "watching"  # in force, no copy yet
    assert torch.ones(3).to(torch.float64).dtype == torch.float64  # every other call unchanged
    autogaudi.disable()
    assert torch.Tensor.to is original and "to" not in vars(torch.Tensor)


def test_failure_at_run_time_reverts_and_the_copy_still_happens(hpu_double, monkeypatch):
    from autogaudi.optimizations import non_blocking_copy

    hpu_double(lazy=True)
    original = torch.Tensor.to
    autogaudi.enable(device="hpu", only="non_blocking_copy")
    monkeypatch.setattr(non_blocking_copy, "wants_non_blocking", lambda *args: 1 / 0)
    assert torch.ones(2).to(torch.float64).dtype == torch.float64  # the user's call is still served
    row = autogaudi.report().unit("non_blocking_copy")
    assert (row["status"], row["reason_code"]) == ("failed", "failed_at_run_time")
    assert row["reason_params"]["error"].startswith("ZeroDivisionError")
    assert torch.Tensor.to is original
