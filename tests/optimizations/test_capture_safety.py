"""Capture never breaks a script and leaves nothing behind: the user's objects stay
picklable and copyable while captured, a rejected trial and disable() leave the process as it was,
a module called several times per step is found, and a captured call that fails runs eagerly."""

import copy
import gc
import io
import json
import pickle
import weakref

import pytest
import torch
from torch import nn

import autogaudi
from autogaudi.backends import base
from autogaudi.backends.cpu import CpuBackend
from autogaudi.optimizations import step_profiler
from tests.helpers import REPO, clean_env, run_python, said
from tests.optimizations.test_step_profiler import STEPS

CAPTURE_UNITS = "step_profiler,graph_capture,channels_last"


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3)
    )


def batches(shape=(16,), size=8):
    generator = torch.Generator().manual_seed(1)
    while True:
        yield torch.randn(size, *shape, generator=generator), torch.randint(0, 3, (size,), generator=generator)


def train(model, data, steps, optimizer=None):
    optimizer = optimizer or torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _, (inputs, labels) in zip(range(steps), data):
        loss = nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


def unit_row(name):
    return autogaudi.report().unit(name)


def process_state():
    """What a capture or a trial must leave as it found it, process-wide."""
    module = torch.nn.modules.module
    return {
        "global_hooks": (len(module._global_forward_pre_hooks), len(module._global_forward_hooks)),
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "threads": torch.get_num_threads(),
        "autogaudi_compiled_entries": len(
            torch._dynamo.eval_frame._debug_get_cache_entry_list(base._caller(None).__code__)
        ),
    }


def assert_plain_copies(model, inputs):
    """torch.save, pickle and deepcopy work, and what they give back is a plain module."""
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(twin) is type(model) and "_compiled_call_impl" not in vars(twin)
        assert twin.state_dict().keys() == model.state_dict().keys()
        torch.testing.assert_close(twin(inputs), model._call_impl(inputs))


def test_a_captured_model_saves_pickles_and_copies_as_a_plain_one():
    autogaudi.enable(device="cpu", only=CAPTURE_UNITS, force="graph_capture")
    model = mlp()
    keys = set(vars(model))
    train(model, batches(), STEPS + 3)
    assert (unit_row("graph_capture")["reason_code"], unit_row("graph_capture")["reason_params"]) == (
        "captured_forced",
        {"model": "Sequential"},
    )
    (change,) = autogaudi.report().changed()
    assert change["unit"] == "graph_capture"
    assert change["what"].startswith("Sequential captured (torch.compile), one-off "), change
    assert "(set up " in change["what"] and ", warm up " in change["what"], change  # import, first compile
    assert type(model) is nn.Sequential and model.forward.__func__ is nn.Sequential.forward
    assert_plain_copies(model, torch.randn(4, 16))
    autogaudi.disable()
    assert set(vars(model)) == keys


def slow_graphs(monkeypatch, clock=None, seconds=0.004):
    """A capture that is correct but, on the trials' ``clock``, slower than eager: what a trial must
    reject (without a clock: a capture that only calls the module's own code)."""

    def graph_forward(self, module, exact_random=False, static_outputs=True):
        def call(*args, **kwargs):
            if clock is not None:
                clock.advance(seconds)
            return module._call_impl(*args, **kwargs)

        return call

    monkeypatch.setattr(CpuBackend, "graph_forward", graph_forward)


def collectable(run) -> None:
    """``run()`` returns a weak reference to the model it trained; nothing of autogaudi's may keep
    it alive. (Run in its own frame: a frame's locals snapshot would hold the model otherwise.)"""
    alive = run()
    gc.collect()
    assert alive() is None, [type(r) for r in gc.get_referrers(alive())]


def read_as(monkeypatch, bound):
    monkeypatch.setattr(
        step_profiler.classification, "classify", lambda *a, **k: (bound, f"read as {bound}-bound by the test")
    )


@pytest.mark.parametrize(
    "make, shape, bound, candidate",
    [
        (mlp, (16,), "host", "graph_capture"),
        (cnn, (3, 8, 8), "host", "graph_capture"),
        (cnn, (3, 8, 8), "device", "channels_last"),
    ],
    ids=["mlp-capture", "cnn-capture", "cnn-channels-last"],
)
def test_a_rejected_trial_leaves_the_process_and_the_model_as_they_were(
    monkeypatch, step_clock, capture_one_off, make, shape, bound, candidate
):
    slow_graphs(monkeypatch, step_clock)
    read_as(monkeypatch, bound)
    from autogaudi.measure import trials
    from autogaudi.optimizations import channels_last

    monkeypatch.setattr(trials, "MARGIN", 0.0)
    capture_one_off(CpuBackend, 0.0)
    step_clock.tick = 1e-6  # the profile's steps take some time too: it reads the one clock
    real_in_layout = channels_last._in_layout

    def slow_in_layout(layout, args, kwargs):  # 4 ms per argument converted: the trial measures it slower
        step_clock.advance(0.004 * (len(args) + len(kwargs)))
        return real_in_layout(layout, args, kwargs)

    monkeypatch.setattr(channels_last, "_in_layout", slow_in_layout)
    before = process_state()
    autogaudi.enable(device="cpu", only=CAPTURE_UNITS, trial=candidate)

    def run():
        model = make()
        model_keys = set(vars(model))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        optimizer_keys = set(vars(optimizer))
        layouts = [p.is_contiguous() for p in model.parameters()]
        train(model, batches(shape), STEPS + 60, optimizer)
        records = autogaudi.report().trials
        assert [(r["candidate"], r["decision"]) for r in records] == [(candidate, "rejected")], records
        assert unit_row(candidate)["reason_code"] == "rejected"
        assert autogaudi.report().changed() == []  # a rejected candidate changed nothing
        assert autogaudi.settled() and autogaudi.report().steps["decisions_settled_at_step"] is not None
        assert process_state() == before
        assert set(vars(model)) == model_keys and set(vars(optimizer)) == optimizer_keys
        assert [p.is_contiguous() for p in model.parameters()] == layouts
        assert not model._forward_pre_hooks and "_compiled_call_impl" not in vars(model)
        assert_plain_copies(model, torch.randn(4, *shape))
        return weakref.ref(model)

    collectable(run)


@pytest.mark.slow
def test_disable_after_a_real_capture_drops_compiled_code_and_the_model():
    before = process_state()

    def run():
        autogaudi.enable(device="cpu", only=CAPTURE_UNITS, force="graph_capture")
        model = mlp()
        train(model, batches(), STEPS + 3)
        assert process_state()["autogaudi_compiled_entries"] >= 1  # the capture really compiled
        autogaudi.disable()
        assert process_state() == before
        return weakref.ref(model)

    collectable(run)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, inputs):
        return self.body(inputs).view(-1)


def gan_losses(steps, device="cpu"):
    """DCGAN's loop: the discriminator on real, then on fake (detached), both losses backpropagated
    before its step; then on fake again for the generator."""
    torch.manual_seed(0)
    generator_net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8)).to(device)
    critic = Discriminator().to(device)
    opt_d = torch.optim.Adam(critic.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(generator_net.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    data = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        real = torch.randn(16, 8, generator=data).to(device)
        noise = torch.randn(16, 4, generator=data).to(device)
        critic.zero_grad()
        loss_real = bce(critic(real), torch.ones(16, device=device))
        loss_real.backward()
        fake = generator_net(noise)
        loss_fake = bce(critic(fake.detach()), torch.zeros(16, device=device))
        loss_fake.backward()
        opt_d.step()
        generator_net.zero_grad()
        loss_g = bce(critic(fake), torch.ones(16, device=device))
        loss_g.backward()
        opt_g.step()
        losses.append((loss_real + loss_fake).item() + loss_g.item())
    return losses, critic


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a lent GPU)"),
        ],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_a_discriminator_called_three_times_per_step_trains_like_plain(device):
    plain, _ = gan_losses(STEPS + 8, device)
    autogaudi.enable(device=device, only=CAPTURE_UNITS, force="graph_capture")
    losses, critic = gan_losses(STEPS + 8, device)
    row = unit_row("graph_capture")
    assert unit_row("step_profiler")["figures"]["model_calls_per_step"] == 3
    assert (row["status"], row["reason_code"], row["reason_params"]) == (
        "applied",
        "captured_forced",
        {"model": "Discriminator"},
    ), row
    assert ("captured_called_several_times", {"model": "Discriminator", "calls": 3}) in said(row)
    torch.testing.assert_close(losses, plain, rtol=1e-3, atol=1e-4)
    assert_plain_copies(critic, torch.randn(4, 8, device=device))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))

    def forward(self, inputs):
        return self.body(inputs)


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.tower = Tower()
        self.head = nn.Linear(8, 1)

    def forward(self, left, right):
        return self.head((self.tower(left) - self.tower(right)).abs()).view(-1)


def siamese_losses(steps, shared_at_top_level):
    """Two siamese shapes: the tower called twice inside one module (pytorch/examples), or called
    twice by the loop itself with a contrastive loss on both outputs."""
    model = Siamese()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(4)
    losses = []
    for _ in range(steps):
        left, right = torch.randn(8, 16, generator=data), torch.randn(8, 16, generator=data)
        if shared_at_top_level:
            a, b = model.tower(left), model.tower(right)
            loss = ((a - b) ** 2).sum(1).mean() + model.head.weight.sum() * 0
        else:
            loss = nn.functional.binary_cross_entropy_with_logits(model(left, right), torch.ones(8))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("shared_at_top_level, calls", [(False, 1), (True, 2)], ids=["inside", "loop"])
def test_siamese_towers_train_like_plain_under_forced_capture(shared_at_top_level, calls):
    plain = siamese_losses(STEPS + 6, shared_at_top_level)
    autogaudi.enable(device="cpu", only=CAPTURE_UNITS, force="graph_capture")
    losses = siamese_losses(STEPS + 6, shared_at_top_level)
    assert unit_row("step_profiler")["figures"]["model_calls_per_step"] == calls
    assert unit_row("graph_capture")["status"] == "applied"
    torch.testing.assert_close(losses, plain, rtol=1e-3, atol=1e-4)


def test_channels_last_steps_aside_for_a_model_that_capture_holds():
    autogaudi.enable(device="cpu", only=CAPTURE_UNITS, force="graph_capture,channels_last")
    model = cnn()
    train(model, batches((3, 8, 8)), STEPS + 2)
    assert (unit_row("graph_capture")["reason_code"], unit_row("graph_capture")["reason_params"]) == (
        "captured_forced",
        {"model": "Sequential"},
    )
    assert unit_row("channels_last")["reason_code"] == "captured"
    assert all(p.is_contiguous() for p in model.parameters())


def test_a_captured_call_that_fails_runs_eagerly_and_capture_goes_off(monkeypatch, capsys):
    def graph_forward(self, module, exact_random=False, static_outputs=True):
        def call(*args, **kwargs):
            raise RuntimeError("injected: the captured graph broke")

        return call

    monkeypatch.setattr(CpuBackend, "graph_forward", graph_forward)
    plain, _ = train(mlp(), batches(), STEPS + 4)
    autogaudi.enable(device="cpu", only=CAPTURE_UNITS, force="graph_capture")
    model = mlp()
    losses, _ = train(model, batches(), STEPS + 4)
    assert losses == plain  # the failing call ran eagerly: not one step lost or changed
    row = unit_row("graph_capture")
    assert (row["status"], row["reason_code"]) == ("failed", "failed_at_run_time")
    assert "injected" in row["reason_params"]["error"]
    assert "_compiled_call_impl" not in vars(model)
    assert "graph_capture raised" in capsys.readouterr().err


class RejectsSmallBatches(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 3)

    def forward(self, inputs):
        if inputs.shape[0] < 8:
            raise ValueError("the user's own error")
        return self.linear(inputs)


def test_the_users_own_error_inside_a_captured_model_propagates_unchanged(monkeypatch):
    slow_graphs(monkeypatch)  # a capture that calls the module's own code
    autogaudi.enable(device="cpu", only=CAPTURE_UNITS, force="graph_capture")
    model = RejectsSmallBatches()
    train(model, batches(), STEPS + 2)
    with pytest.raises(ValueError, match="^the user's own error$") as raised:
        model(torch.randn(4, 16))
    assert raised.value.__context__ is None and raised.value.__cause__ is None  # not chained to ours
    assert unit_row("graph_capture")["status"] == "applied"  # the user's error is not blamed on capture


def test_a_census_that_fails_to_start_leaves_no_hook_or_mode(monkeypatch):
    before = process_state()

    def broken(self, repeats=100):
        raise RuntimeError("injected: calibration failed")

    monkeypatch.setattr(step_profiler.census._Census, "calibrate", broken)
    autogaudi.enable(device="cpu", only="step_profiler")
    train(mlp(), batches(), STEPS)
    assert unit_row("step_profiler")["status"] == "failed"
    assert process_state() == before


def test_calls_outside_training_run_eagerly_and_compile_nothing_more():
    autogaudi.enable(device="cpu", only=CAPTURE_UNITS, force="graph_capture")
    model = mlp()
    train(model, batches(), STEPS + 3)
    compiled = process_state()["autogaudi_compiled_entries"]
    assert compiled >= 1
    inputs = torch.randn(4, 16)
    model.eval()
    with torch.no_grad():
        evaluated = model(inputs)
    model.train()
    with torch.no_grad():
        watched = model(inputs)  # a training-mode call under no_grad: not a training step either
    assert process_state()["autogaudi_compiled_entries"] == compiled  # no eval-mode recompilation
    torch.testing.assert_close(evaluated, model.eval()._call_impl(inputs))
    torch.testing.assert_close(watched, model.train()._call_impl(inputs))
    assert "eager_outside_training" in unit_row("graph_capture")["note_codes"]
    assert (unit_row("graph_capture")["reason_code"], unit_row("graph_capture")["reason_params"]) == (
        "captured_forced",
        {"model": "Sequential"},
    )  # still on for training


def test_compiles_for_later_input_shapes_are_part_of_the_one_off():
    autogaudi.enable(device="cpu", only=CAPTURE_UNITS, force="graph_capture")
    model = mlp()
    train(model, batches(), STEPS + 3)
    assert "later_compiles_s" not in unit_row("graph_capture")["figures"]
    # A new rank (a batch dimension that dynamo may already treat as dynamic would not recompile).
    model(torch.randn(2, 4, 16)).sum().backward()
    figures = unit_row("graph_capture")["figures"]
    assert figures["later_compiles_s"] > 0
    (change,) = autogaudi.report().changed()
    assert "later compiles" in change["what"]


EXITS_WITH_COMPILE_WORKERS = """
import sys, torch
from torch import nn
sys.path.insert(0, {repo!r})
from tests.optimizations.test_capture_safety import batches, mlp, train
model = mlp()
train(model, batches(), 30)
import torch._inductor.async_compile as async_compile
async_compile.AsyncCompile.process_pool()  # what a compile that wants parallel workers starts
"""


@pytest.mark.slow
def test_shutting_down_the_compile_workers_capture_started_is_measured_at_exit(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(EXITS_WITH_COMPILE_WORKERS.format(repo=str(REPO)))
    report = tmp_path / "report.json"
    result = run_python(
        "-m", "autogaudi", "--device", "cpu", "--only", CAPTURE_UNITS, "--force", "graph_capture",
        "--report", str(report), str(script), env=clean_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (row,) = [unit for unit in json.loads(report.read_text())["units"] if unit["name"] == "graph_capture"]
    assert row["figures"]["compile_workers_at_exit_s"] > 0
    assert "compile workers at exit" in result.stderr
