"""What each unit does to the numbers, said and sized: the measuring functions (on copies, leaving
the script's tensors as they were), and common script shapes under the default options, each of
which gives the plain run's numbers or has the report name the unit that changed them."""

import copy
import dataclasses
import json

import pytest
import torch

import autogaudi
from autogaudi.backends.cpu import CpuBackend
from autogaudi.measure import numerics
from tests.helpers import SCRIPTS, run_python


def test_the_largest_relative_difference_is_norm_wise_and_absolute_against_zeros():
    expected = [torch.tensor([1.0, -4.0, 1e-30]), torch.zeros(3), torch.ones(0)]
    actual = [torch.tensor([1.0, -4.0 * (1 + 2**-20), 2e-30]), torch.full((3,), 1e-9), torch.ones(0)]
    # 4 * 2**-20 against the largest magnitude 4; the tiny element does not count relative to itself
    assert numerics.largest_relative_difference(actual, expected) == pytest.approx(2**-20)
    assert numerics.largest_relative_difference([torch.zeros(3)], [torch.zeros(3)]) == 0.0
    assert numerics.largest_relative_difference([], []) == 0.0


def stepped(steps=2):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randn(4, 6)).pow(2).sum().backward()
        optimizer.step()
    model(torch.randn(4, 6)).pow(2).sum().backward()  # gradients of the step to come
    return model, optimizer


def test_torchs_unfused_update_is_computed_on_copies():
    model, optimizer = stepped()
    before = copy.deepcopy(optimizer.state_dict()), [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    update = numerics.unfused_update(optimizer, type(optimizer).step.__wrapped__)
    # the optimizer, its parameters and their gradients are as they were
    assert all(map(torch.equal, model.parameters(), before[1]))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    state = optimizer.state_dict()
    assert all(
        torch.equal(state["state"][index][key], before[0]["state"][index][key])
        for index in state["state"]
        for key in state["state"][index]
    )
    optimizer.step()  # the real step, the same settings: the same numbers, bit for bit
    assert all(map(torch.equal, update, model.parameters()))


class _SeenAsDevice(torch.Tensor):
    """Changes only what Python sees, as the HPU double's tensors do."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_parameters_count_as_plain_unless_they_dispatch_ops_their_own_way():
    from torch.distributed.tensor import DTensor

    seen_as_device = torch.ones(2).as_subclass(_SeenAsDevice).requires_grad_()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2)), seen_as_device], lr=0.1)
    assert numerics.plain_tensors(optimizer)
    distributed = type("LikeDTensor", (torch.Tensor,), {"__torch_dispatch__": DTensor.__torch_dispatch__})
    optimizer.param_groups[0]["params"].append(torch.ones(2).as_subclass(distributed))
    assert not numerics.plain_tensors(optimizer)


def test_a_copy_is_made_only_where_it_fits_in_a_share_of_the_memory_free(monkeypatch):
    tensors = [torch.zeros(1024)]  # 4 KiB
    monkeypatch.setattr(numerics, "free_bytes", lambda backend, device: 4096 / numerics.FREE_SHARE)
    assert numerics.copy_fits(tensors, CpuBackend("test"))
    monkeypatch.setattr(numerics, "free_bytes", lambda backend, device: 4095 / numerics.FREE_SHARE)
    assert not numerics.copy_fits(tensors, CpuBackend("test"))
    monkeypatch.setattr(numerics, "free_bytes", lambda backend, device: None)  # cannot tell: no copy
    assert not numerics.copy_fits(tensors, CpuBackend("test"))


SHAPES = SCRIPTS / "numerics_shapes.py"


def numbers(result) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, options, named",
    [
        # a starving loader over a dataset with its own RandomState: kept in-process (holds_generator)
        ("augment", [], {}),
        # one that counts and caches in __getitem__: kept in-process (mutates_state)
        ("counting", [], {}),
        # auto: checked against float32 on a copy, then tried in bf16 on the run's own steps; kept
        # or not, those steps ran in bf16
        ("precision", ["--precision", "auto"], {"mixed_precision": ["precision"]}),
    ],
)
def test_a_common_shape_gives_plain_numbers_or_the_report_names_what_changed_them(tmp_path, shape, options, named):
    plain = numbers(run_python(SHAPES, shape))
    report = tmp_path / "report.json"
    result = run_python("-m", "autogaudi", *options, "--quiet", "--report", report, SHAPES, shape)
    said = {row["unit"]: row["how"] for row in json.loads(report.read_text())["numerics"]}
    assert said == named
    # the losses, parameters and random streams, and the threads, num_workers, counts the script reads
    assert (numbers(result) == plain) == (not named)


@pytest.mark.slow
def test_a_host_bound_mlp_with_dropout_names_the_capture_trial_it_asked_for(monkeypatch):
    """Whatever the capture trial (asked for: it changes the numbers) decides, its steps ran compiled
    dropout, which draws other masks from the script's generator: the losses after it differ, and the
    report says graph_capture changed random draws and rounding, measured with the masks in it."""
    from autogaudi.optimizations import step_profiler

    monkeypatch.setattr(
        step_profiler.classification, "classify", lambda *a, **k: ("host", "read as host-bound by the test")
    )
    monkeypatch.setattr(CpuBackend, "least_capture_one_off_s", 0.0)
    monkeypatch.setattr(CpuBackend, "capture_one_off_rate_s", 1e-12)  # no one-off to wait for

    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.2), torch.nn.Linear(32, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
        losses = []
        for _ in range(step_profiler_steps() + 40):
            loss = torch.nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 3, (8,)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses, torch.get_rng_state()

    plain, plain_stream = run()
    autogaudi.enable(device="cpu", trial="graph_capture")
    losses, stream = run()
    report = autogaudi.report()
    assert [trial["candidate"] for trial in report.trials] == ["graph_capture"]
    [numbers] = report.numerics()
    assert (numbers["unit"], numbers["how"]) == ("graph_capture", ["rounding", "random"])
    assert (
        numbers["measured"]["of"] == "outputs, dropout masks drawn otherwise"
        and numbers["measured"]["max_rel_diff"] > 0
    )
    assert "dropout_differs" in report.unit("graph_capture")["note_codes"]
    assert losses != plain and not torch.equal(stream, plain_stream)


def step_profiler_steps() -> int:
    from tests.optimizations.test_step_profiler import STEPS

    return STEPS


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: tuple
    steps: int


def test_every_floating_tensor_of_an_output_is_compared_dataclasses_and_containers_included():
    a, b, c = torch.ones(2), torch.zeros(3), torch.full((1,), 2.0)
    output = (Output(a, (b, torch.arange(3)), 7), {"extra": c, "count": 1})
    assert [id(t) for t in numerics.float_leaves(output)] == [id(a), id(b), id(c)]


class Noisy(torch.nn.Module):
    """Dropout, BatchNorm buffers, a user's hook: what a measurement must leave as it found it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(6, 6)
        self.norm = torch.nn.BatchNorm1d(6)
        self.drop = torch.nn.Dropout(0.5)
        self.heard = []
        self.register_forward_hook(lambda *_: self.heard.append("hook"))

    def forward(self, inputs):
        return self.drop(self.norm(self.linear(inputs)))


def test_a_forward_difference_leaves_the_model_its_hooks_and_every_random_stream_as_they_were():
    import random

    import numpy

    model, inputs = Noisy(), torch.randn(4, 6)
    heard_globally = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: heard_globally.append(1))
    state = copy.deepcopy(model.state_dict())
    streams = (torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].copy())
    try:
        same = numerics.forward_difference(model, (inputs,), {}, CpuBackend("test"))
        assert same == 0.0  # the same generator state for both forwards: the same masks
        doubled = numerics.forward_difference(
            model, (inputs,), {}, CpuBackend("test"), around=lambda copy, args, kwargs: copy(*args) * 2
        )
        assert doubled > 0.5
    finally:
        handle.remove()
    assert model.heard == [] and heard_globally == [] and torch.is_grad_enabled()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert torch.equal(streams[0], torch.get_rng_state()) and streams[1] == random.getstate()
    assert (streams[2] == numpy.random.get_state()[1]).all()


def test_a_copy_that_does_not_fit_or_cannot_run_is_not_measured_and_says_which(monkeypatch):
    model, inputs = Noisy(), torch.randn(4, 6)

    def raises(copy, args, kwargs):
        raise RuntimeError("the copy's own failure")

    with pytest.raises(numerics.NotMeasured) as failed:
        numerics.forward_difference(model, (inputs,), {}, CpuBackend("test"), around=raises)
    assert failed.value.code == "failed" and "RuntimeError" in failed.value.params["error"]
    monkeypatch.setattr(numerics, "FREE_SHARE", 0.0)
    with pytest.raises(numerics.NotMeasured) as memory:
        numerics.forward_difference(model, (inputs,), {}, CpuBackend("test"))
    assert memory.value.code == "memory"
