"""channels_last: conv models (and their optimizer buffers) switch format with the same numerics,
the trial's steps train like plain ones, models without convolutions and disable() are left as is."""

import pytest
import torch
from torch import nn

import autogaudi
from autogaudi.measure import numerics
from autogaudi.optimizations import step_profiler
from autogaudi.optimizations.channels_last import ChannelsLast, to_memory_format
from tests.optimizations.test_step_profiler import STEPS


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 4),
    )


def train(model, steps):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        images, labels = torch.randn(8, 3, 16, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, optimizer


def test_forced_converts_model_inputs_and_momentum_with_the_same_losses():
    plain, _ = train(cnn(), STEPS + 10)
    autogaudi.enable(device="cpu", only="step_profiler,channels_last", force="channels_last")
    model = cnn()
    seen = []
    model[0].register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    losses, optimizer = train(model, STEPS + 10)
    torch.testing.assert_close(losses, plain, rtol=1e-4, atol=1e-5)
    weight = model[0].weight
    assert weight.is_contiguous(memory_format=torch.channels_last)
    assert optimizer.state[weight]["momentum_buffer"].is_contiguous(memory_format=torch.channels_last)
    assert seen[0] is False and seen[-1] is True  # the first convolution gets channels_last inputs
    autogaudi.disable()
    assert weight.is_contiguous() and optimizer.state[weight]["momentum_buffer"].is_contiguous()
    assert len(model._forward_pre_hooks) == 0  # autogaudi's input hook is gone


def test_trial_steps_train_like_plain_and_are_reported():
    plain, _ = train(cnn(), STEPS + 35)
    autogaudi.enable(device="cpu", only="step_profiler,channels_last", trial="channels_last")
    losses, _ = train(cnn(), STEPS + 35)
    torch.testing.assert_close(losses, plain, rtol=1e-4, atol=1e-5)
    (trial,) = autogaudi.report().trials
    assert trial["candidate"] == "channels_last" and trial["decision"] in ("kept", "rejected")
    code = autogaudi.report().unit("channels_last")["reason_code"]
    assert code == {"kept": "measured_faster", "rejected": "rejected"}[trial["decision"]]


def test_models_without_convolutions_are_left_alone():
    autogaudi.enable(device="cpu", only="step_profiler,channels_last")
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    assert autogaudi.report().unit("channels_last")["reason_code"] == "no_conv2d"


def test_a_model_not_found_is_not_a_model_without_convolutions():
    """Parameters trained through functional calls, no module: "not found" is said, never "none"."""
    autogaudi.enable(device="cpu", only="step_profiler,channels_last")
    weight = torch.randn(2, 4, requires_grad=True)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    for _ in range(STEPS):
        nn.functional.linear(torch.randn(2, 4), weight).sum().backward()
        optimizer.step()
    assert autogaudi.report().unit("channels_last")["reason_code"] == "no_training_model"


def test_no_trial_on_an_input_bound_step(monkeypatch):
    """Both arms would time mostly the wait for data (0.42x read on an input-bound ResNet-18)."""
    from autogaudi.optimizations import step_profiler

    monkeypatch.setattr(
        step_profiler.classification, "classify", lambda *a, **k: ("input", "waiting for data 70% of each step")
    )
    autogaudi.enable(device="cpu", only="step_profiler,channels_last")
    train(cnn(), STEPS + 10)
    assert autogaudi.report().trials == []
    assert autogaudi.report().unit("channels_last")["reason_code"] == "input_bound"


def test_the_conversion_is_a_function_that_round_trips_model_and_optimizer_state():
    model = cnn()
    optimizer = torch.optim.Adam(model.parameters())
    nn.functional.cross_entropy(model(torch.randn(8, 3, 16, 16)), torch.randint(0, 4, (8,))).backward()
    optimizer.step()  # moments exist
    weight = model[0].weight
    moments = [optimizer.state[weight][key] for key in ("exp_avg", "exp_avg_sq")]
    before = [tensor.clone() for tensor in (weight, *moments)]
    to_memory_format(model, optimizer, torch.channels_last)
    converted = [weight, optimizer.state[weight]["exp_avg"], optimizer.state[weight]["exp_avg_sq"]]
    assert all(tensor.is_contiguous(memory_format=torch.channels_last) for tensor in converted)
    assert model[0].weight is weight  # the same Parameter: the optimizer's references hold
    to_memory_format(model, optimizer, torch.contiguous_format)
    after = [weight, optimizer.state[weight]["exp_avg"], optimizer.state[weight]["exp_avg_sq"]]
    assert all(tensor.is_contiguous() for tensor in after)
    assert all(torch.equal(a, b) for a, b in zip(after, before))


def test_the_script_sees_its_parameters_strides_unchanged_until_the_trial_keeps_channels_last(step_clock):
    """While the trial runs only the inputs go in channels_last: a script reading its weight's
    strides (or its gradient's) between steps reads its own layout until the decision is kept."""
    from autogaudi.entry import runtime

    autogaudi.enable(device="cpu", only="step_profiler,channels_last", trial="channels_last")
    model = cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    nhwc = []
    model[0].register_forward_pre_hook(
        lambda _m, args: nhwc.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    trials = runtime._STATE.session.trials
    weight, own, seen = model[0].weight, model[0].weight.stride(), []
    for _ in range(STEPS + 60):
        images, labels = torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))
        nn.functional.cross_entropy(model(images), labels).backward()
        step_clock.advance(0.001 if nhwc[-1] else 0.002)  # the NHWC arm is the faster
        seen.append((weight.stride(), weight.grad.stride(), bool(trials.records)))
        optimizer.step()
        optimizer.zero_grad()
    (record,) = trials.records
    assert record["decision"] == "kept" and any(nhwc)
    assert all(strides == own and grad == own for strides, grad, decided in seen if not decided)
    assert seen[-1][0] == (own[0], 1, own[1], own[2])  # kept: now the parameters too
    assert autogaudi.report().unit("channels_last")["reason_code"] == "measured_faster"


def _forced_run(steps=STEPS + 3):
    """Losses, parameters, BatchNorm's running statistics and the random streams of a forced run."""
    import random

    torch.manual_seed(3)
    random.seed(3)
    model = cnn()
    losses, _ = train(model, steps)
    state = [tensor.clone() for tensor in model.state_dict().values()]
    return losses, state, torch.get_rng_state(), random.getstate()


def test_kept_channels_last_is_measured_on_copies_and_the_run_is_unchanged(monkeypatch):
    # Both runs take every census pair, so that channels_last switches on at the same step in each
    # (pairs that settle early on this machine's clock would move it).
    monkeypatch.setattr(step_profiler.classification, "settled", lambda clean, censuses: False)
    autogaudi.enable(device="cpu", only="step_profiler,channels_last", force="channels_last")
    measured = _forced_run()
    row = autogaudi.report().unit("channels_last")
    figure = row["figures"]["numerics_measured"]
    assert (figure["of"], figure["steps"]) == ("outputs", 1)
    assert figure["max_rel_diff"] < 1e-4
    autogaudi.disable()
    monkeypatch.setattr(ChannelsLast, "_measure_numerics", lambda *args: None)
    autogaudi.enable(device="cpu", only="step_profiler,channels_last", force="channels_last")
    unmeasured = _forced_run()
    assert measured[0] == unmeasured[0]
    assert all(torch.equal(a, b) for a, b in zip(measured[1], unmeasured[1]))  # BatchNorm's buffers too
    assert torch.equal(measured[2], unmeasured[2]) and measured[3] == unmeasured[3]


def _copy_fails(model):
    raise RuntimeError("a module that cannot be copied")


@pytest.mark.parametrize(
    ("patch", "code"), [("copy_fits", "numerics_not_measured_memory"), ("plain_copy", "numerics_not_measured_failed")]
)
def test_a_copy_that_would_not_fit_or_run_leaves_channels_last_on_and_not_measured(monkeypatch, patch, code):
    monkeypatch.setattr(numerics, patch, (lambda tensors, backend: False) if patch == "copy_fits" else _copy_fails)
    autogaudi.enable(device="cpu", only="step_profiler,channels_last", force="channels_last")
    train(cnn(), STEPS + 3)
    row = autogaudi.report().unit("channels_last")
    assert "numerics_measured" not in row["figures"]
    assert code in row["note_codes"] and row["status"] == "applied"
