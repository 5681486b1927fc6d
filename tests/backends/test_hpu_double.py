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


def _compiles(calls):
    return [kwargs["kind"] for name, kwargs in calls.CALLS if name == "hpu_backend_compile"]


def test_a_model_on_hpu_compiles_with_hpu_backend_without_a_graph_break_and_computes_as_eager(hpu_double):
    """Dynamo traces HPU tensors as the host tensors they hold: one graph each way, results and
    gradients on hpu, the numbers eager's."""
    calls = hpu_double(lazy=False, host_stands_for_device=False)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    breaks = sum(counters["graph_break"].values())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).to("hpu")
    inputs = torch.randn(3, 4, device="hpu")
    output = torch.compile(model, backend="hpu_backend")(inputs)
    output.sum().backward()
    assert output.device.type == "hpu" and {p.grad.device.type for p in model.parameters()} == {"hpu"}
    compiled_grads = [p.grad.cpu() for p in model.parameters()]
    model.zero_grad()
    eager = model(inputs)
    eager.sum().backward()
    torch.testing.assert_close(output.cpu(), eager.cpu(), rtol=0, atol=0)
    assert all(torch.equal(a, p.grad.cpu()) for a, p in zip(compiled_grads, model.parameters()))
    assert _compiles(calls) == ["forward", "backward"] and sum(counters["graph_break"].values()) == breaks
    with pytest.raises(RuntimeError, match="same device"):  # eager code after the region is the double's again
        output + torch.ones(3, 2)


COMPILED_ON_HPU = """
import torch
from habana_frameworks.torch.hpu import metrics
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to("hpu")
loss = torch.compile(model, backend="hpu_backend")(torch.randn(5, 4, device="hpu")).sum()
loss.backward()
print(loss.device, dict(metrics.metric_global("graph_compilation").stats())["TotalNumber"],
      dict(metrics.metric_global("recipe_cache").stats())["TotalHit"], round(loss.item(), 5))
"""


@pytest.mark.slow
def test_a_second_process_compiling_a_model_on_hpu_finds_every_graph_in_the_recipe_cache(tmp_path):
    env = clean_env(PYTHONPATH=str(HPU_DOUBLE), PT_HPU_RECIPE_CACHE_CONFIG=f"{tmp_path},false,100")
    first, second = (run_python("-c", COMPILED_ON_HPU, env=env) for _ in range(2))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    (device, compiled, hits, loss), (device_again, compiled_again, hits_again, loss_again) = (
        run.stdout.split() for run in (first, second)
    )
    assert (device, compiled, hits) == ("hpu:0", "2", "0")
    assert (device_again, compiled_again, hits_again, loss_again) == ("hpu:0", "0", "2", loss)
