"""The anatomy of a step's memory: the first real training step measured and the steps after it
forecast from it, the second step measured too, only where a budget is known; the run's numbers and
step counts as plain's."""

import torch

import autogaudi
from autogaudi.backends.base import GB
from autogaudi.core import session
from autogaudi.entry import runtime
from autogaudi.measure import fake_step, step_memory
from autogaudi.watch import model_call
from tests.gpt_model import TinyGPT, train

ROOMY = 1.0  # GiB: far above the test GPT's step


def memory_section():
    return autogaudi.report().as_dict()["memory"]


def test_without_a_budget_on_the_cpu_nothing_is_tracked():
    autogaudi.enable(device="cpu")
    losses, model = train(steps=3)
    memory = memory_section()
    assert memory["state"] == "off"
    assert memory["budget_bytes"] is None and memory["predicted_peak_bytes"] is None and memory["peak_bytes"] is None
    assert model_call.holder(model, model_call.Layer.TRACK) is None  # (the OOM rescue layer is another unit's)
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_a_budget_forecasts_the_step_and_measures_the_second_one():
    plain, _ = train()
    autogaudi.enable(device="cpu", memory_limit=ROOMY, only="step_profiler")  # no unit that rounds otherwise
    losses, model = train()
    memory = memory_section()
    assert memory["state"] == "measured"
    assert memory["budget_bytes"] == int(ROOMY * GB)
    assert set(memory["parts"]) == set(step_memory.PARTS)
    parameters = memory["parts"]["parameters"]
    assert 2 * parameters <= memory["parts"]["optimizer_state"] < 2.01 * parameters  # AdamW's moments and steps
    assert memory["parts"]["activations"] > 0
    assert abs(memory["predicted_peak_bytes"] - memory["peak_bytes"]) <= 0.1 * memory["peak_bytes"]
    assert losses == plain  # the tracker changed no op
    steps = autogaudi.report().as_dict()["steps"]
    assert steps["optimizer_steps"] == steps["steps"] == 5
    assert model_call.route_of(model) is None  # the tracking layer went with the measured step
    assert not torch.nn.modules.module._global_forward_pre_hooks


def test_the_short_report_shows_memory_only_where_it_matters():
    autogaudi.enable(device="cpu", memory_limit=ROOMY)
    train(steps=3)
    assert not memory_section()["matters"]
    assert not any(line.startswith("  memory") for line in autogaudi.report().format(verbose=False).splitlines())
    autogaudi.disable()
    autogaudi.enable(device="cpu", memory_limit=memory_section_peak() / GB * 1.05)
    train(steps=3)
    assert memory_section()["matters"]
    assert any(line.startswith("  memory") for line in autogaudi.report().format(verbose=False).splitlines())


def memory_section_peak():
    return memory_section()["peak_bytes"]


def test_the_forecast_leaves_the_model_and_optimizer_as_they_were():
    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    idx = torch.randint(0, 128, (4, 32))
    forecast = fake_step.predict(model, optimizer, (idx, idx), {})
    assert forecast.peak > 0 and forecast.parts["optimizer_state"] > 0
    assert not optimizer.state  # no step taken on the real one
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_a_forward_that_reads_a_value_is_measured_and_forecast():
    class Reads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.linear(x)
            return y * float(y.sum().item() > 0)  # a value fake tensors would not have: the step is real

    autogaudi.enable(device="cpu", memory_limit=ROOMY)
    model = Reads()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    memory = memory_section()
    assert memory["predicted_peak_bytes"] > 0 and memory["not_forecast"] is None
    assert memory["state"] == "measured" and memory["peak_bytes"] > 0


def test_disable_before_the_measured_step_takes_everything_off():
    autogaudi.enable(device="cpu", memory_limit=ROOMY)
    torch.manual_seed(0)
    model = TinyGPT()
    idx = torch.randint(0, 128, (2, 32))
    model(idx, idx).backward()
    assert model_call.route_of(model) is not None
    autogaudi.disable()
    assert model_call.holder(model, model_call.Layer.TRACK) is None  # (the OOM rescue layer is another unit's)
    assert not torch.nn.modules.module._global_forward_pre_hooks
    assert runtime._STATE.session is None or not runtime._STATE.session.active


def test_the_memory_limit_option_takes_gigabytes():
    from autogaudi.core.errors import OptionsError
    from autogaudi.core.options import Options

    assert Options(memory_limit="1.5").memory_limit == 1.5
    assert Options.from_env({"AUTOGAUDI_MEMORY_LIMIT": "2"}).memory_limit == 2.0
    assert Options().memory_limit is None
    for wrong in ("0", "-1", "lots", "inf"):
        try:
            Options(memory_limit=wrong)
        except OptionsError:
            continue
        raise AssertionError(f"memory_limit={wrong!r} accepted")


def test_on_cuda_the_limit_is_enforced_by_the_allocator_and_given_back(monkeypatch):
    from types import SimpleNamespace

    from autogaudi.backends.cuda import CudaBackend

    fractions = [0.75]  # what the script set
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GB))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: fractions[-1])
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda fraction, device: fractions.append(fraction)
    )
    undo = CudaBackend("test").limit_memory(20 * GB)
    assert fractions[-1] == 0.25
    undo()
    assert fractions[-1] == 0.75


def test_a_model_called_twice_in_a_step_is_measured_and_the_run_is_plains():
    """Gradient accumulation calls the model twice before the optimizer steps: torch's tracker
    refuses a second call of its root; the watcher's measures it call after call."""

    def accumulate():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for _ in range(4):
            for half in torch.ones(2, 4, 8).unbind():
                loss = model(half).pow(2).mean() / 2
                loss.backward()
                losses.append(loss.item())
            optimizer.step()
            optimizer.zero_grad()
        return losses

    plain = accumulate()
    autogaudi.enable(device="cpu", memory_limit=ROOMY, only="step_profiler")
    assert accumulate() == plain
    memory = memory_section()
    assert memory["state"] == "measured" and memory["not_measured"] is None
    assert memory["peak_bytes"] > 0 and memory["predicted_peak_bytes"] > 0


def test_an_evaluation_between_steps_neither_starts_nor_spoils_the_measured_step():
    """minGPT's trainer samples with generate() after an optimizer step: several calls of the model
    without gradients, where the measured step would otherwise start or still be tracked."""

    def train_and_sample():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        losses = []
        for _ in range(4):
            loss = model(torch.ones(4, 8)).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                for _ in range(3):
                    model(torch.ones(1, 8))
            losses.append(loss.item())
        return losses

    plain = train_and_sample()
    autogaudi.enable(device="cpu", memory_limit=ROOMY, only="step_profiler")
    assert train_and_sample() == plain
    memory = memory_section()
    assert memory["state"] == "measured" and memory["not_measured"] is None
    assert abs(memory["predicted_peak_bytes"] - memory["peak_bytes"]) <= 0.1 * memory["peak_bytes"]


def params_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_far_below_the_devices_capacity_nothing_is_forecast_or_tracked(monkeypatch):
    """An accelerator's capacity as the budget (no --memory-limit): a model whose whole state is a
    sliver of it pays neither the forecast nor a tracked step."""
    plain, _ = train()
    monkeypatch.setattr(session, "budget_possible", lambda options, backend: True)  # as on an accelerator
    monkeypatch.setattr(step_memory, "budget_bytes", lambda options, backend: GB)
    autogaudi.enable(device="cpu", only="activation_checkpointing")
    losses, model = train()
    memory = memory_section()
    assert memory["state"] == "far_below"
    assert memory["predicted_peak_bytes"] is None and memory["peak_bytes"] is None
    assert memory["measuring_s"] == 0.0
    assert 4 * params_bytes(model) <= memory["state_bytes"] < step_memory.FORECAST_FROM * GB
    assert autogaudi.report().unit("activation_checkpointing")["reason_code"] == "far_below"
    assert model_call.holder(model, model_call.Layer.TRACK) is None
    assert losses == plain


def test_near_the_devices_capacity_the_step_is_forecast_and_its_cost_counted(monkeypatch):
    plain, model = train()
    capacity = 10 * params_bytes(model)  # the state bound (4x the parameters) over FORECAST_FROM of it
    monkeypatch.setattr(session, "budget_possible", lambda options, backend: True)
    monkeypatch.setattr(step_memory, "budget_bytes", lambda options, backend: capacity)
    autogaudi.enable(device="cpu", only="activation_checkpointing")
    losses, _ = train()
    report = autogaudi.report().as_dict()
    assert report["memory"]["state"] == "measured" and report["memory"]["predicted_peak_bytes"] > 0
    assert report["memory"]["measuring_s"] > 0
    whole = report["summary"]["whole_run"]
    assert whole["measuring_s"] >= report["memory"]["measuring_s"] and whole["cost_s"] >= whole["measuring_s"]
    assert losses == plain


def test_a_forward_with_gradients_and_no_backward_is_not_tracked_for_the_rest_of_the_run():
    """Inference that forgot ``no_grad``: the first call looks like a training step's, but no backward
    pass ever comes; the tracker (a dispatch mode over every op) goes after a few calls."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    autogaudi.enable(device="cpu", memory_limit=ROOMY, only="step_profiler")
    model = torch.nn.Linear(4, 4)
    for _ in range(step_memory.CALLS_WITHOUT_BACKWARD + 2):
        model(torch.ones(2, 4))
    memory = memory_section()
    assert memory["state"] == "not_measured" and memory["peak_bytes"] is None
    assert not _get_current_dispatch_mode_stack()
    assert model_call.route_of(model) is None
