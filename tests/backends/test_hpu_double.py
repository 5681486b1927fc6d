"""The HPU double itself: its HPU tensors behave as a Gaudi's where a script can tell, and each
release it models loads the bridge as that release does."""

import io

import pytest
import torch

from tests.helpers import HPU_DOUBLE, clean_env, run_python


def test_a_host_tensor_meeting_an_hpu_one_raises_as_on_a_gaudi(hpu_double):
    hpu_double()
    with pytest.raises(RuntimeError, match="same device"):
        torch.ones(2, device="hpu") + torch.ones(2)
    with pytest.raises(RuntimeError, match="same device"):
        torch.nn.Linear(2, 1).to("hpu")(torch.ones(3, 2))
    assert (torch.ones(2, device="hpu") * torch.tensor(3.0)).device.type == "hpu"  # a 0-dim host scalar may
    assert torch.ones(2).to("hpu").device == torch.device("hpu", 0)


def test_a_model_moved_to_hpu_trains_there_and_computes_what_the_host_computes(hpu_double):
    hpu_double()

    def train(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        weight = model[0].weight
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)  # built before the move, as scripts do
        model.to(device)
        assert model[0].weight is weight and isinstance(weight, torch.nn.Parameter)
        for _ in range(3):
            inputs, targets = torch.randn(6, 4).to(device), torch.randn(6, 1).to(device)
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        return model, loss

    model, loss = train("hpu")
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters()), loss]
    assert {tensor.device.type for tensor in tensors} == {"hpu"}
    host_model, host_loss = train("cpu")
    assert loss.item() == host_loss.item()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(model.parameters(), host_model.parameters()))
    model.to("cpu")
    assert {p.device.type for p in model.parameters()} == {"cpu"} and type(model[0].weight) is torch.nn.Parameter


def test_hpu_tensors_leave_the_device_as_plain_tensors(hpu_double):
    hpu_double()
    on_device = torch.arange(3.0, device="hpu")
    assert type(on_device.cpu()) is torch.Tensor and type(on_device.to("cpu")) is torch.Tensor
    assert repr(on_device) == "tensor([0., 1., 2.], device='hpu:0')"
    with pytest.raises(TypeError, match="cpu"):
        on_device.numpy()
    buffer = io.BytesIO()
    torch.save({"weight": on_device}, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer)["weight"]) is torch.Tensor  # loadable where no bridge is


@pytest.mark.parametrize(
    "release, env, loaded",
    [
        ("latest", {}, True),
        ("latest", {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}, False),
        ("latest", {"PT_HPU_LAZY_MODE": "1"}, False),
        ("1.19", {}, False),
        ("1.19", {"PT_HPU_AUTOLOAD": "1"}, True),
    ],
)
def test_import_torch_loads_the_bridge_as_each_release_does(release, env, loaded):
    code = "import sys, torch; print('habana_frameworks.torch' in sys.modules)"
    result = run_python("-c", code, env=clean_env(PYTHONPATH=str(HPU_DOUBLE), HPU_DOUBLE_RELEASE=release, **env))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(loaded)]
