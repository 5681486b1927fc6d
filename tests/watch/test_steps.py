"""Training steps are iterations of the user's loop, however it updates its parameters: by hand
(no torch.optim), with two optimizers per iteration (a GAN), with per-layer optimizers that train
one after another (forward-forward), or with LBFGS's closure (many backward passes per step)."""

import warnings

import pytest
import torch
from torch import nn

import autogaudi
from autogaudi.watch import evaluation, steps
from autogaudi.watch.step_count import NO_OPTIMIZER_AFTER, REPACE_AFTER


def steps_figures():
    return autogaudi.report().as_dict()["steps"]


def data(seed=0):
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator)


def train_by_hand(model, iterations: int) -> None:
    """pytorch/examples' regression and word_language_model: p.data.add_(p.grad, alpha=-lr)."""
    for _, (inputs, targets) in zip(range(iterations), data()):
        model.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        for param in model.parameters():
            param.data.add_(param.grad, alpha=-0.01)


def test_a_loop_that_updates_its_parameters_by_hand_is_profiled():
    autogaudi.enable(device="cpu", only="step_profiler")
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    iterations = 40
    train_by_hand(model, iterations)
    figures = steps_figures()
    assert figures["steps_counted_by"] == "backward passes"
    # the passes before the counting mode was known count too, once it is
    assert figures["steps"] == iterations and figures["optimizer_steps"] == 0
    row = autogaudi.report().unit("step_profiler")
    assert row["figures"]["bound"] in ("host", "device", "unclear") and row["figures"]["model"] == "Sequential", row
    assert figures["backward_passes_per_step"] == 1


def test_two_optimizers_per_iteration_make_one_step():
    autogaudi.enable(device="cpu", only="throughput_meter")
    generator_net, critic = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_g = torch.optim.SGD(generator_net.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(critic.parameters(), lr=0.01)
    for _, (inputs, _targets) in zip(range(12), data()):
        critic(generator_net(inputs).detach()).mean().backward()
        opt_d.step()
        opt_d.zero_grad()
        critic(generator_net(inputs)).mean().backward()
        opt_g.step()
        opt_g.zero_grad()
    figures = steps_figures()
    assert (figures["steps"], figures["optimizer_steps"], figures["steps_counted_by"]) == (12, 24, "optimizer steps")


def test_per_layer_optimizers_that_train_in_turn_hand_the_count_on():
    """forward-forward: layer 1 trains with its optimizer, then layer 2 with its own."""
    autogaudi.enable(device="cpu", only="throughput_meter")
    layers = [nn.Linear(4, 4), nn.Linear(4, 4)]
    optimizers = [torch.optim.SGD(layer.parameters(), lr=0.01) for layer in layers]  # both kept, as there
    for layer, optimizer in zip(layers, optimizers):
        for _, (inputs, _targets) in zip(range(20), data()):
            layer(inputs).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    # layer 2's optimizer paces once it has stepped REPACE_AFTER + 1 times with layer 1's silent
    assert steps_figures()["steps"] == 20 + 20 - REPACE_AFTER


def test_lbfgs_closure_backward_passes_are_inside_one_step_and_leave_the_losss_graph_unsearched(monkeypatch):
    """Whether a pass accumulates is asked only of the loop's own passes: inside ``step(closure)``
    the loss's graph (a thousand-step ``cat`` in pytorch/examples' time sequence) is not walked."""
    searched = []
    monkeypatch.setattr(steps, "_a_parameter", lambda tensors: searched.append(tensors))
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = nn.Linear(4, 1)
    optimizer = torch.optim.LBFGS(
        model.parameters(), max_iter=NO_OPTIMIZER_AFTER + 4, tolerance_grad=0.0, tolerance_change=0.0
    )  # every iteration runs
    inputs, targets = next(data())

    def closure():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        return loss

    for _ in range(3):
        optimizer.step(closure)
    figures = steps_figures()
    assert figures["steps_counted_by"] == "optimizer steps"
    assert figures["steps"] == figures["optimizer_steps"] == 3
    assert figures["backward_passes_in_optimizer_steps"] == figures["backward_passes"] > NO_OPTIMIZER_AFTER
    assert searched == []


def test_the_watchs_work_inside_the_users_backward_passes_is_counted_as_autogaudis_own():
    """A loop without regions or loaders: what the report calls per-call work is the watch's own."""
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = nn.Linear(4, 1)  # its initialisation enters no_grad: the region watch's time, not the passes'
    before = autogaudi.report().as_dict()["timeline"]["per_call_s"]
    train_by_hand(model, 200)  # the report rounds to 0.1 ms
    assert autogaudi.report().as_dict()["timeline"]["per_call_s"] > before


def test_the_parameter_that_tells_accumulation_apart_is_found_behind_a_wide_join():
    """A loss over the ``cat`` of many time steps' outputs: the parameters sit a few nodes below
    each output, past the search's bound for a level-by-level walk of the join's inputs."""
    cell, head = nn.RNNCell(1, 8), nn.Linear(8, 1)
    hidden, outputs = torch.zeros(2, 8), []
    for step in torch.randn(2, steps.LEAF_SEARCH * 2).split(1, dim=1):
        hidden = cell(step, hidden)
        outputs.append(head(hidden))
    loss = torch.cat(outputs, dim=1).pow(2).mean()
    found = steps._a_parameter(loss)
    assert any(found is param for param in [*cell.parameters(), *head.parameters()])


def test_an_optimizer_step_that_raised_does_not_hide_later_backward_passes():
    """A step(closure) whose closure raises never reaches its post-hook; the loop catches the error
    and goes on updating by hand: those backward passes are steps again."""
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = nn.Linear(4, 1)
    optimizer = torch.optim.LBFGS(model.parameters())
    inputs, targets = next(data())

    def failing_closure():
        nn.functional.mse_loss(model(inputs), targets).backward()
        raise FloatingPointError("the script's own")

    try:
        optimizer.step(failing_closure)
    except FloatingPointError:
        pass
    iterations = NO_OPTIMIZER_AFTER + 8
    train_by_hand(model, iterations)
    figures = steps_figures()
    assert figures["steps_counted_by"] == "backward passes"
    assert figures["steps"] == iterations and figures["backward_passes_in_optimizer_steps"] == 1


def test_accumulation_by_hand_counts_one_step_per_update():
    """Gradients cleared every 4 passes: 4 passes make a step, before and after the counting mode is known."""
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = nn.Linear(4, 1)
    batches = data()
    for _ in range(30):
        model.zero_grad()
        for _ in range(4):
            inputs, targets = next(batches)
            nn.functional.mse_loss(model(inputs), targets).backward()
        for param in model.parameters():
            param.data.add_(param.grad, alpha=-0.01)
    figures = steps_figures()
    assert (figures["steps"], figures["backward_passes"], figures["backward_passes_per_step"]) == (30, 120, 4)
    assert len(autogaudi.report().as_dict()["timeline"]["step_s"]) == 30  # one point per step, not per pass


def test_autograd_grad_passes_are_seen_and_a_gradient_penalty_is_not_a_pass():
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = nn.Linear(4, 1)
    for _, (inputs, targets) in zip(range(20), data()):
        inputs.requires_grad_(True)
        output = model(inputs)
        (slope,) = torch.autograd.grad(output.sum(), inputs, create_graph=True)  # part of the loss
        loss = nn.functional.mse_loss(output, targets) + slope.pow(2).mean()
        grads = torch.autograd.grad(loss, list(model.parameters()))
        with torch.no_grad():
            for param, grad in zip(model.parameters(), grads):
                param -= 0.01 * grad
    figures = steps_figures()
    assert (figures["steps"], figures["backward_passes"], figures["steps_counted_by"]) == (20, 20, "backward passes")


def test_a_pass_inside_a_pass_is_not_the_loops_own():
    """Reentrant checkpointing runs a backward pass inside the backward pass."""
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _, (inputs, targets) in zip(range(5), data()):
        output = torch.utils.checkpoint.checkpoint(model, inputs.requires_grad_(True), use_reentrant=True)
        nn.functional.mse_loss(output, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    figures = steps_figures()
    assert (figures["steps"], figures["backward_passes"], figures["own_backward_passes"]) == (5, 5, 5)


class SlowFirstCall(nn.Module):
    """A model whose first forward takes ``FIRST_CALL_S`` of the step clock (lazy initialisation):
    that time is the first step's."""

    def __init__(self, clock):
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.clock = clock
        self.initialised = False

    def forward(self, inputs):
        if not self.initialised:
            self.clock.advance(FIRST_CALL_S)
            self.initialised = True
        return self.layer(inputs)


FIRST_CALL_S, SET_UP_S = 0.05, 0.5


def train_and_evaluate(model, epochs: int, steps: int, evaluations: int) -> None:
    """pytorch/examples' mnist shape: train, then an evaluation loop under no_grad, each epoch; the
    loss is measured against a teacher called under no_grad in every step (not a model trained)."""
    teacher = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = data()
    for _ in range(epochs):
        model.train()
        for _, (inputs, _targets) in zip(range(steps), batches):
            with torch.no_grad():
                targets = teacher(inputs)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            for _, (inputs, _targets) in zip(range(evaluations), batches):
                model(inputs)


def test_evaluation_passes_are_counted_apart_from_steps():
    autogaudi.enable(device="cpu", only="throughput_meter")
    train_and_evaluate(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)), epochs=3, steps=20, evaluations=5)
    report = autogaudi.report().as_dict()
    figures = report["steps"]
    assert (figures["steps"], figures["optimizer_steps"], figures["evaluation_forward_passes"]) == (60, 60, 15)
    evaluated = [(event["step"], event["passes"]) for event in report["timeline"]["events"]]
    assert evaluated == [(20, 5), (40, 5), (60, 5)]
    assert len(report["timeline"]["step_s"]) == 60


def test_evaluation_per_batch_and_before_training_counts_once_the_model_is_known():
    """``@torch.no_grad()`` per batch, and an evaluation before the first step (the model's training
    is not known yet then): each pass counted once, none as a step; torch.inference_mode too."""
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = nn.Linear(4, 1)
    evaluate = torch.no_grad()(model)
    for _, (inputs, _targets) in zip(range(3), data()):
        evaluate(inputs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _, (inputs, targets) in zip(range(5), data()):
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.inference_mode():
        model(torch.randn(2, 4))
    figures = steps_figures()
    assert (figures["steps"], figures["evaluation_forward_passes"]) == (5, 4)


def test_a_loop_that_evaluates_in_every_step_stops_being_counted_and_says_so():
    """An RL rollout: the policy called without gradients several times per step. Counting each call
    would cost it a hook's registration; from the check step on the regions are torch's own again."""
    entered = torch.no_grad.__enter__
    autogaudi.enable(device="cpu", only="throughput_meter")
    policy = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.01)
    for step in range(1, evaluation.EVALUATION_CHECKED_AT_STEP + 6):
        for _ in range(3):
            with torch.no_grad():
                policy(torch.randn(1, 4))
        policy(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        assert (torch.no_grad.__enter__ is entered) == (step >= evaluation.EVALUATION_CHECKED_AT_STEP)
    figures = steps_figures()
    assert figures["evaluation_counted_until_step"] == evaluation.EVALUATION_CHECKED_AT_STEP
    assert figures["evaluation_forward_passes"] == 3 * evaluation.EVALUATION_CHECKED_AT_STEP


def test_a_rollout_then_several_updates_stops_being_counted_and_says_so():
    """CleanRL's PPO: a rollout of one no_grad region per environment step, then several updates
    with no calls between them. Not every step has passes, but there are more regions than steps."""
    entered = torch.no_grad.__enter__
    autogaudi.enable(device="cpu", only="throughput_meter")
    policy = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.01)
    for _ in range(4):
        for _ in range(8):
            with torch.no_grad():
                policy(torch.randn(1, 4))
        for _ in range(4):
            policy(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert torch.no_grad.__enter__ is entered
    figures = steps_figures()
    assert figures["evaluation_counted_until_step"] == evaluation.EVALUATION_CHECKED_AT_STEP
    assert figures["evaluation_forward_passes"] == 3 * 8


def test_the_compiled_module_wrapper_stays_on_while_passes_are_counted():
    """With dynamo loaded, the watcher's hook comes and goes per call; OptimizedModule's call wrapper
    does not (wrapping a class attribute per call is per-call work), and disable() takes it off."""
    from torch._dynamo import eval_frame

    original = vars(eval_frame.OptimizedModule)["__call__"]
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = nn.Linear(4, 1)
    seen = set()
    for _ in range(3):
        with torch.no_grad():
            model(torch.randn(1, 4))
        seen.add(id(vars(eval_frame.OptimizedModule)["__call__"]))
    assert len(seen) == 1 and id(original) not in seen
    autogaudi.disable()
    assert vars(eval_frame.OptimizedModule)["__call__"] is original


def test_a_loop_that_evaluates_now_and_then_is_counted_for_the_whole_run():
    """A bigram LM's script: many evaluation passes before the first steps (more than steps by the
    check step), a few later, and generate() at the end: every one counted, none left out."""
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    evaluated = 0
    for step in range(3 * evaluation.EVALUATION_CHECKED_AT_STEP):
        if step % evaluation.EVALUATION_CHECKED_AT_STEP == 0:
            with torch.no_grad():
                for _ in range(2 * evaluation.EVALUATION_CHECKED_AT_STEP):
                    model(torch.randn(1, 4))
                    evaluated += 1
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        for _ in range(5):
            model(torch.randn(1, 4))
            evaluated += 1
    figures = steps_figures()
    assert figures["evaluation_counted_until_step"] is None
    assert figures["evaluation_forward_passes"] == evaluated


def test_regions_inside_gradients_already_off_leave_training_calls_unwatched():
    """An optimizer's step turns gradients off as a function and enters no_grad regions inside: no
    region of its own, so the training forward after it has no global module hook (which would cost
    every call, and which torch.compile would guard on)."""
    from torch.nn.modules import module as torch_module

    autogaudi.enable(device="cpu", only="throughput_meter")
    model = nn.Linear(4, 1)
    optimizer = torch.optim.Adam(model.parameters(), foreach=True)  # groups tensors under @no_grad
    for _, (inputs, targets) in zip(range(3), data()):
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert not torch_module._global_forward_pre_hooks and not torch_module._global_forward_hooks
    with torch.set_grad_enabled(False):  # the transfer-learning tutorial's evaluation phase
        model(torch.randn(2, 4))
    assert steps_figures()["evaluation_forward_passes"] == 1


def test_evaluation_passes_of_a_model_the_script_compiled_are_counted_and_torch_warns_nothing():
    """nanoGPT's ``estimate_loss``: a ``torch.compile(model)`` called under ``@torch.no_grad()``. The
    watcher's global hook sees the ``OptimizedModule``'s call as its own hook would, so torch's warning
    about global hooks with torch.compile(module) is not raised, and each pass is counted once."""
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = torch.compile(nn.Linear(4, 1), backend="eager")
    evaluate = torch.no_grad()(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step, (inputs, targets) in zip(range(6), data()):
                if step % 3 == 0:
                    evaluate(inputs)
                nn.functional.mse_loss(model(inputs), targets).backward()
                optimizer.step()
                optimizer.zero_grad()
        assert [str(warning.message) for warning in caught] == []
        figures = steps_figures()
        assert (figures["steps"], figures["evaluation_forward_passes"]) == (6, 2)
    finally:
        torch._dynamo.reset()


def test_evaluation_passes_of_a_loop_that_updates_by_hand():
    """No optimizer: the model the hand-written loop updates is the one trained."""
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    train_by_hand(model, NO_OPTIMIZER_AFTER + 4)
    with torch.no_grad():
        for _, (inputs, _targets) in zip(range(7), data()):
            model(inputs)
    train_by_hand(model, 1)
    figures = steps_figures()
    assert figures["steps"] == NO_OPTIMIZER_AFTER + 5 and figures["evaluation_forward_passes"] == 7


def test_the_first_step_is_timed_from_its_batch(step_clock):
    """The first step's point on the timeline covers its forward (lazy initialisation), not only its
    backward pass, and not the set-up before its batch."""
    autogaudi.enable(device="cpu", only="throughput_meter", warmup_steps=1)
    model = SlowFirstCall(step_clock)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(12, 4), torch.randn(12, 1)), 4)
    step_clock.advance(SET_UP_S)
    for inputs, targets in loader:
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    timeline = autogaudi.report().as_dict()["timeline"]
    assert timeline["first_step_from"] == "batch"
    assert timeline["step_s"] == [pytest.approx(FIRST_CALL_S), 0, 0]
    assert "steps_per_s" not in steps_figures()  # no rate from steps the clock gave no time
    assert autogaudi.report().unit("throughput_meter")["status"] != "failed"


def test_without_a_loader_the_first_step_is_timed_from_the_start(step_clock):
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = SlowFirstCall(step_clock)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step_clock.advance(SET_UP_S)
    for _, (inputs, targets) in zip(range(3), data()):
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    timeline = autogaudi.report().as_dict()["timeline"]
    assert timeline["first_step_from"] == "start"
    assert timeline["step_s"] == [pytest.approx(SET_UP_S + FIRST_CALL_S), 0, 0]


def test_an_evaluation_before_training_is_not_the_first_steps_time(step_clock):
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = SlowFirstCall(step_clock)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.no_grad():
        model(torch.randn(2, 4))  # lazy initialisation, and the evaluation's time
        step_clock.advance(SET_UP_S)
    for _, (inputs, targets) in zip(range(3), data()):
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        step_clock.advance(0.01)
        optimizer.zero_grad()
    timeline = autogaudi.report().as_dict()["timeline"]
    assert timeline["first_step_from"] == "start"
    assert timeline["step_s"] == [0, pytest.approx(0.01), pytest.approx(0.01)]


class NoGradInside(nn.Module):
    """A forward that runs a part of itself without gradients (a running statistic, a target)."""

    def __init__(self):
        super().__init__()
        self.body, self.target = nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, inputs):
        with torch.no_grad():
            target = self.target(inputs)
        return self.body(inputs) - target


def test_a_no_grad_block_inside_a_forward_is_no_evaluation():
    autogaudi.enable(device="cpu", only="throughput_meter")
    model = NoGradInside()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _, (inputs, targets) in zip(range(6), data()):
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        model(torch.randn(2, 4))
    figures = steps_figures()
    assert (figures["steps"], figures["evaluation_forward_passes"]) == (6, 1)
