"""The core's verdict on where the training's work is (autogaudi/watch/placement.py), backend by backend."""

import types

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import autogaudi
from autogaudi.watch import placement as placement_module
from autogaudi.watch.placement import Placement, parameters_reached


@pytest.fixture(autouse=True)
def real_probe(monkeypatch):
    """The probe as on real hardware (the HPU double, loaded by an earlier test, answers it otherwise)."""
    monkeypatch.setattr(placement_module, "device_type_of", lambda tensor: tensor.device.type)


class Recorder:
    """What the placement sees of a session: its backend, and the call it makes off the device."""

    def __init__(self, device_type):
        self.backend = types.SimpleNamespace(device_type=device_type)
        self.off_device = []

    def work_off_device(self, device, at):
        self.off_device.append((device, at))


def test_the_parameters_a_loss_trains_are_found_through_autograd():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    loss = model(torch.ones(2, 3)).sum()
    found = parameters_reached(loss)
    assert found and all(any(p is q for q in model.parameters()) for p in found)
    assert parameters_reached(torch.ones(2)) == []


@pytest.mark.parametrize("backend", ["cuda", "hpu"])
def test_a_host_model_on_an_accelerator_backend_is_off_the_device_once(backend):
    session = Recorder(backend)
    placement = Placement(session)
    model = torch.nn.Linear(3, 1)
    placement.observe_backward(model(torch.ones(2, 3)).sum())
    placement.observe(model.parameters(), "optimizer's construction")  # a verdict is taken once
    assert placement.on_device is False
    assert session.off_device == [("cpu", "first backward")]


def test_on_the_cpu_backend_the_host_is_the_device():
    session = Recorder("cpu")
    placement = Placement(session)
    placement.observe(torch.nn.Linear(3, 1).parameters(), "optimizer's construction")
    assert placement.on_device is True and session.off_device == []


def test_no_verdict_without_floating_point_parameters():
    placement = Placement(Recorder("cuda"))
    placement.observe([torch.ones(2, dtype=torch.long)], "optimizer's construction")
    assert placement.on_device is None and placement.as_dict() is None


def test_loaders_built_before_the_model_stop_pinning_and_padding_when_it_stays_on_the_host(hpu_double):
    hpu_double(lazy=True)
    placement_module.device_type_of = lambda tensor: tensor.device.type  # the double's probe, put back by real_probe
    autogaudi.enable(device="hpu", only="fused_optimizer,pin_memory,static_last_batch,step_marks")
    loader = DataLoader(TensorDataset(torch.randn(10, 2)), batch_size=4)
    assert loader.pin_memory is True and len(loader) == 3 and len(list(loader.sampler)) == 12
    model = torch.nn.Linear(2, 1)
    torch.optim.AdamW(model.parameters())
    assert loader.pin_memory is False and len(list(loader.sampler)) == 10
    report = autogaudi.report()
    for name in ("fused_optimizer", "pin_memory", "static_last_batch", "step_marks"):
        assert report.unit(name)["reason_code"] == "model_not_on_device", name
    assert report.backend["placement"] == {"device": "cpu", "at": "optimizer's construction", "on_device": False}
