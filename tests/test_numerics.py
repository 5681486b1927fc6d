"""What each unit does to the numbers, said and sized: the measuring functions (on copies, leaving
the script's tensors as they were), and common script shapes under the default options, each of
which gives the plain run's numbers or has the report name the unit that changed them."""

import copy
import json

import pytest
import torch

import autogaudi
from autogaudi import numerics
from autogaudi.backends.cpu import CpuBackend
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
def test_a_host_bound_mlp_with_dropout_under_the_defaults_names_its_capture_trial(monkeypatch):
    """Whatever the capture trial decides, its steps ran compiled dropout, which draws other masks
    from the script's generator: the losses after it differ, and the report says graph_capture
    changed random draws and rounding (not measured)."""
    from autogaudi.optimizations import step_profiler

    monkeypatch.setattr(step_profiler, "classify", lambda *a, **k: ("host", "read as host-bound by the test"))
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
    autogaudi.enable(device="cpu")
    losses, stream = run()
    report = autogaudi.report()
    assert [trial["candidate"] for trial in report.trials] == ["graph_capture"]
    assert report.numerics() == [{"unit": "graph_capture", "how": ["rounding", "random"], "measured": None}]
    assert "dropout_differs" in report.unit("graph_capture")["note_codes"]
    assert losses != plain and not torch.equal(stream, plain_stream)


def step_profiler_steps() -> int:
    from tests.optimizations.test_step_profiler import STEPS

    return STEPS
