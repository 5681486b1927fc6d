"""step_marks against the HPU double: the exact mark_step sequence for each loop shape, and unchanged losses."""

import pytest
import torch

import autogaudi

MARK = "mark_step"


def make_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def batches(count, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 6, generator=generator), torch.randn(5, 1, generator=generator)) for _ in range(count)]


def standard_loop(steps=4, clip=False):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for inputs, targets in batches(steps):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def accumulation_loop(steps=3, micro=2):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    data = batches(steps * micro)
    for step in range(steps):
        for inputs, targets in data[step * micro : (step + 1) * micro]:
            loss = torch.nn.functional.mse_loss(model(inputs), targets) / micro
            torch.autograd.backward(loss)
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def two_optimizers_with_grad_scaler(steps=3):
    model = make_model()
    first = torch.optim.SGD(model[0].parameters(), lr=0.05)
    second = torch.optim.Adam(model[2].parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    losses = []
    for inputs, targets in batches(steps):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(first)
        scaler.step(second)
        scaler.update()
        first.zero_grad()
        second.zero_grad()
        losses.append(loss.item())
    return losses


def lbfgs_loop(steps=2):
    model = make_model()
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    inputs, targets = batches(1)[0]
    losses = []

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        return loss

    for _ in range(steps):
        losses.append(optimizer.step(closure).item())
    return losses


def manual_update_loop(steps=3):
    model = make_model()
    losses = []
    for inputs, targets in batches(steps):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(parameter.grad, alpha=-0.05)
                parameter.grad = None
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "loop, expected_marks",
    [
        (standard_loop, [MARK, MARK] * 4),  # after backward, after step
        (accumulation_loop, [MARK, MARK, MARK] * 3),  # two backwards, one step
        (two_optimizers_with_grad_scaler, [MARK, MARK, MARK] * 3),  # one backward, two steps
        (manual_update_loop, [MARK] * 3),  # no optimizer: after backward only
    ],
)
def test_mark_sequence_and_unchanged_losses(hpu_double, loop, expected_marks):
    calls = hpu_double(lazy=True)
    plain = loop()
    autogaudi.enable(device="hpu", only="step_marks")
    calls.reset()
    assert loop() == plain  # marks flush work; they never change the math
    assert calls.names() == expected_marks
    row = autogaudi.report().unit("step_marks")
    assert row["status"] == "applied" and row["figures"]["mark_steps"] == len(expected_marks)


def test_lbfgs_closure_marks_every_evaluation_and_every_step(hpu_double):
    calls = hpu_double(lazy=True)
    plain = lbfgs_loop()
    autogaudi.enable(device="hpu", only="step_marks")
    calls.reset()
    assert lbfgs_loop() == plain
    report = autogaudi.report().as_dict()
    backwards, steps = report["steps"]["backward_passes"], report["steps"]["optimizer_steps"]
    assert steps == 2 and backwards > steps
    assert calls.names() == [MARK] * (backwards + steps)


@pytest.mark.parametrize(
    "lazy, options, code",
    [(False, {"only": "step_marks"}, "hpu_eager"), (True, {"disable": "step_marks,fused_optimizer"}, "switched_off")],
)
def test_skipped_with_the_reason_and_no_marks(hpu_double, lazy, options, code):
    calls = hpu_double(lazy=lazy)
    autogaudi.enable(device="hpu", **options)
    standard_loop()
    row = autogaudi.report().unit("step_marks")
    assert (row["status"], row["reason_code"]) == ("skipped", code)
    # no mark of autogaudi's: in lazy mode the only ones are those the bridge's synchronize makes
    # (step_profiler's census starts with a synchronize at step 4)
    assert calls.names().count(MARK) == calls.names().count("synchronize") * lazy


def test_not_applied_on_cpu():
    autogaudi.enable(device="cpu")
    row = autogaudi.report().unit("step_marks")
    assert (row["status"], row["reason_code"], row["reason_params"]["backend"]) == ("skipped", "other_backend", "cpu")


def test_evaluation_loops_mark_once_per_batch(hpu_double):
    calls = hpu_double(lazy=True)
    model = make_model()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 6)), batch_size=4)
    with torch.no_grad():
        plain = [model(inputs).sum().item() for (inputs,) in loader]
    autogaudi.enable(device="hpu", only="step_marks")
    calls.reset()
    with torch.no_grad():
        marked = [model(inputs).sum().item() for (inputs,) in loader]
    assert marked == plain
    assert calls.names() == [MARK] * 4  # before each of 3 batches, and before the end of the loop
    for _ in loader:  # a training-mode pass over the data is not an evaluation iteration
        pass
    assert calls.names() == [MARK] * 4
    assert autogaudi.report().unit("step_marks")["figures"]["eval_marks"] == 4
