"""fused_optimizer on the real CPU (torch fused=True) and against the HPU double (hpex FusedAdamW/FusedSGD)."""

import copy
import gc
import io
import pickle
import sys
import types

import pytest
import torch

import autogaudi
from autogaudi.entry import runtime
from tests.helpers import said

STEPS = 50
# torch's fused CPU kernel reassociates float math; the hpex double computes the same formulas.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)
# The bridge's FusedAdamW adds eps to the un-corrected sqrt(v): eps / sqrt(1 - beta2^t) against torch's
# eps, largest in the first steps (3e-7 at t = 1 for eps 1e-8). Measured here: 5e-5 relative in losses.
BRIDGE_ADAMW_TOLERANCE = dict(rtol=2e-4, atol=1e-5)


def tolerance(backend, name):
    return BRIDGE_ADAMW_TOLERANCE if backend == "hpu" and name != "sgd_momentum" else TOLERANCE


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 3))


def train(make_optimizer, steps=STEPS, scheduler=False):
    net = model()
    optimizer = make_optimizer(net)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5) if scheduler else None
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        inputs, labels = torch.randn(8, 10, generator=generator), torch.randint(0, 3, (8,), generator=generator)
        loss = torch.nn.functional.cross_entropy(net(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if schedule:
            schedule.step()
        losses.append(loss.item())
    return losses, net, optimizer


OPTIMIZERS = {
    "adamw": lambda net: torch.optim.AdamW(net.parameters(), lr=3e-3),
    "adamw_hyper": lambda net: torch.optim.AdamW(
        net.parameters(), lr=2e-3, betas=(0.8, 0.95), eps=1e-5, weight_decay=0.1
    ),
    "adam": lambda net: torch.optim.Adam(net.parameters(), lr=3e-3),
    "sgd_momentum": lambda net: torch.optim.SGD(
        net.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4
    ),
    "per_group": lambda net: torch.optim.AdamW(
        [{"params": net[0].parameters(), "weight_decay": 0.0}, {"params": net[3].parameters(), "lr": 1e-3}], lr=3e-3
    ),
}


def counts(row) -> dict:
    """The row's figures less what the first steps measured (rounding and update time: tests below)."""
    return {name: value for name, value in row["figures"].items() if name not in ("numerics_measured", "update_ms")}


def enable(backend):
    """Asked for (``--trial``): on CPU the update is timed before it is fused, as the tests below check."""
    autogaudi.enable(device=backend, only="fused_optimizer", trial="fused_optimizer")


@pytest.fixture(params=["cpu", "hpu"])
def backend(request, hpu_double):
    if request.param == "hpu":
        hpu_double(lazy=True)
    return request.param


@pytest.fixture
def untimed(monkeypatch):
    """The fused update is not timed: a test about what stays fused does not hang on how the real
    clock of a loaded machine weighs the update against the step."""
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer

    monkeypatch.setattr(fused_optimizer.FusedOptimizer, "_timed_here", lambda unit, optimizer: False)


def as_bridge_adamw(make_optimizer):
    """``make_optimizer``'s groups and hyperparameters, updated by the bridge's FusedAdamW formula."""

    def make(net):
        built = make_optimizer(net)
        keys = ("params", "lr", "betas", "eps", "weight_decay")
        groups = [{key: group[key] for key in keys} for group in built.param_groups]
        return BridgeAdamW(groups, **{key: built.defaults[key] for key in keys[1:]})

    return make


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_losses_match_plain_pytorch_over_50_steps(backend, name):
    """With an LR scheduler built after the optimizer, as most scripts do. On the HPU the Adam family
    runs the bridge's formula: its weights equal that formula's, its losses plain's within its bound."""
    plain, plain_net, _ = train(OPTIMIZERS[name], scheduler=True)
    formula = backend == "hpu" and name != "sgd_momentum"
    _, expected_net, _ = train(as_bridge_adamw(OPTIMIZERS[name]), scheduler=True) if formula else (0, plain_net, 0)
    enable(backend)
    fused, fused_net, optimizer = train(OPTIMIZERS[name], scheduler=True)
    torch.testing.assert_close(fused, plain, **tolerance(backend, name))
    torch.testing.assert_close(list(fused_net.parameters()), list(expected_net.parameters()), **TOLERANCE)
    if backend == "hpu":  # on the CPU the fused update is timed, and kept only where it is material
        assert autogaudi.report().unit("fused_optimizer")["figures"]["optimizers_fused"] == 1


class BridgeAdamW(torch.optim.Optimizer):
    """The bridge's FusedAdamW update written from its formula (not from torch, not from the double):
    a group step counter t; w *= 1 - lr*wd; m, v as Adam; w -= lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+eps)."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["t"] = group.get("t", 0) + 1
            (b1, b2), t = group["betas"], group["t"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state.update(m=torch.zeros_like(p), v=torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).add_(p.grad * p.grad, alpha=1 - b2)
                size = group["lr"] * (1 - b2**t) ** 0.5 / (1 - b1**t)
                p.sub_(size * state["m"] / (state["v"].sqrt() + group["eps"]))


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.9, 0.95)])
def test_hpu_adamw_follows_the_bridge_formula_step_after_step(hpu_double, betas):
    """50 steps: equal to the bridge's math (its group counter kept across steps), and to torch's
    AdamW within what eps placement implies. A counter lost every step would scale the learning
    rate by sqrt(1-b2)/(1-b1) (0.32x and 2.24x for these betas) and fail both."""
    hyper = dict(lr=3e-3, betas=betas, eps=1e-8, weight_decay=0.05)
    bridge, bridge_net, _ = train(lambda net: BridgeAdamW(net.parameters(), **hyper))
    torch_losses, torch_net, _ = train(lambda net: torch.optim.AdamW(net.parameters(), **hyper))
    hpu_double(lazy=True)
    enable("hpu")
    fused, fused_net, _ = train(lambda net: torch.optim.AdamW(net.parameters(), **hyper))
    torch.testing.assert_close(list(fused_net.parameters()), list(bridge_net.parameters()), **TOLERANCE)
    torch.testing.assert_close(fused, bridge, **TOLERANCE)
    # parameters whose gradients stay tiny feel eps most: measured 2.8e-4 relative after 50 steps
    torch.testing.assert_close(list(fused_net.parameters()), list(torch_net.parameters()), rtol=1e-3, atol=1e-4)
    row = autogaudi.report().unit("fused_optimizer")
    assert row["figures"]["optimizers_fused"] == 1
    assert row["numerics"] == ["rounding", "formula"]  # eps placed otherwise: not a rounding of AdamW's


def counting(monkeypatch, kernel):
    """Calls of ``torch.<kernel>`` (what torch's fused step runs) from now on."""
    calls = []
    original = getattr(torch, kernel)
    monkeypatch.setattr(torch, kernel, lambda *args, **kwargs: calls.append(kernel) or original(*args, **kwargs))
    return calls


@pytest.mark.parametrize("backend", ["cpu", "hpu"])
def test_under_the_defaults_the_update_is_fused_only_where_no_timing_chooses_it(backend, hpu_double, monkeypatch):
    """Where the host waits for each op (CPU) the fused update would be chosen by a timing, which the
    machine's load moves: under the defaults the optimizer runs as built, plain's numbers bit for
    bit, nothing timed. Where the host runs ahead (HPU) it is fused from the first step, untimed."""
    if backend == "hpu":
        hpu_double(lazy=True)
    plain, plain_net, _ = train(OPTIMIZERS["adamw"], steps=6)
    autogaudi.enable(device=backend, only="fused_optimizer")
    calls = counting(monkeypatch, "_fused_adamw_")
    losses, net, _ = train(OPTIMIZERS["adamw"], steps=6)
    row = autogaudi.report().unit("fused_optimizer")
    if backend == "cpu":
        assert losses == plain and all(map(torch.equal, net.parameters(), plain_net.parameters()))
        assert calls == [] and "update_ms" not in row["figures"]
        assert (row["reason_code"], row["figures"]["optimizers_fused"]) == ("changes_numbers", 0)
    else:
        assert (row["reason_code"], row["figures"]["optimizers_fused"]) == ("hpex", 1)


def test_a_loop_that_updates_its_parameters_by_hand_trains_as_plain_with_the_unit_still_on():
    """No torch.optim (pytorch/examples' regression updates ``param.data`` itself): its steps are paced
    on backward passes and reach the unit with no optimizer, which has nothing to fuse there."""

    def train_by_hand():
        torch.manual_seed(0)
        net = model()
        for _ in range(20):  # more than NO_OPTIMIZER_AFTER backward passes: steps are counted on them
            net.zero_grad()
            net(torch.randn(4, 10)).pow(2).mean().backward()
            for parameter in net.parameters():
                parameter.data.add_(-0.1 * parameter.grad)
        return [parameter.detach().clone() for parameter in net.parameters()]

    plain = train_by_hand()
    enable("cpu")
    assert all(map(torch.equal, train_by_hand(), plain))
    row = autogaudi.report().unit("fused_optimizer")
    assert row["status"] != "failed" and row["figures"]["optimizers_fused"] == 0


def test_cpu_keeps_the_users_object_as_built_and_steps_it_with_torchs_fused_kernel(monkeypatch):
    plain = torch.optim.AdamW(model().parameters(), lr=2e-3, eps=1e-7)
    enable("cpu")
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=2e-3, eps=1e-7)
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.defaults == plain.defaults and optimizer.defaults["fused"] is None
    assert set(vars(optimizer)) == set(vars(plain))  # no attribute, no hook of autogaudi's
    assert all(not hooks for name, hooks in vars(optimizer).items() if name.endswith("_hooks"))
    calls = counting(monkeypatch, "_fused_adamw_")
    net(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    assert calls == ["_fused_adamw_"]
    assert [group["fused"] for group in optimizer.param_groups] == [None]  # set for the update only


def test_hpu_keeps_the_users_object_and_passes_torchs_values_to_fused_adamw(hpu_double):
    calls = hpu_double(lazy=True)
    enable("hpu")
    net = model()
    optimizer = torch.optim.AdamW(net.parameters())  # torch defaults: eps 1e-8, weight_decay 1e-2
    assert type(optimizer) is torch.optim.AdamW and isinstance(optimizer, torch.optim.AdamW)
    net(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    assert calls.names()[:2] == ["FusedAdamW.step", "mark_step"]  # the hpex kernel ran (and marked, lazy)
    group = optimizer.param_groups[0]
    assert (group["eps"], group["weight_decay"], group["lr"]) == (1e-8, 1e-2, 1e-3)


def test_hpu_step_hooks_and_scheduler_see_the_users_object(hpu_double):
    hpu_double(lazy=True)
    enable("hpu")
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(("pre", opt)))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append(("post", opt)))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 0.5**epoch)
    net(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    schedule.step()
    assert seen == [("pre", optimizer), ("post", optimizer)]
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    assert autogaudi.report().as_dict()["steps"]["optimizer_steps"] == 1  # counted once, not twice


def test_add_param_group_and_empty_groups(backend):
    enable(backend)
    net = model()
    optimizer = torch.optim.AdamW([{"params": net[0].parameters()}, {"params": []}], lr=1e-2)
    optimizer.add_param_group({"params": net[3].parameters(), "lr": 1e-3})
    assert len(optimizer.param_groups) == 3  # the user's view keeps the empty group
    before = net[3].weight.detach().clone()
    net(torch.randn(4, 10)).sum().backward()
    optimizer.step()
    assert not torch.equal(net[3].weight, before)  # the group added later is updated too


def saved(*objects):
    """Each object's state_dict through torch.save / torch.load, as a checkpoint file would."""
    buffer = io.BytesIO()
    torch.save([obj.state_dict() for obj in objects], buffer)
    buffer.seek(0)
    return torch.load(buffer)


BATCHES = [
    (torch.randn(8, 10, generator=g), torch.randint(0, 3, (8,), generator=g))
    for g in [torch.Generator().manual_seed(7)]
    for _ in range(20)
]


def train_on(net, optimizer, batches):
    losses = []
    for inputs, labels in batches:
        loss = torch.nn.functional.cross_entropy(net(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run(net, optimizer, first, last):
    return train_on(net, optimizer, BATCHES[first:last])


def resume(make_optimizer, checkpoint, rng):
    net = model()
    optimizer = make_optimizer(net)
    net.load_state_dict(checkpoint[0])
    optimizer.load_state_dict(checkpoint[1])
    torch.set_rng_state(rng)
    return net, optimizer


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd_momentum", "per_group"])
def test_checkpoints_continue_training_exactly_across_plain_and_autogaudi(backend, name, untimed):
    make = OPTIMIZERS[name]
    close = tolerance(backend, name)
    net = model()
    reference_optimizer = make(net)
    reference = run(net, reference_optimizer, 0, 20)  # plain PyTorch, uninterrupted
    plain_keys = set(reference_optimizer.param_groups[0])

    # Written under autogaudi, read by plain PyTorch.
    enable(backend)
    net = model()
    optimizer = make(net)
    first = run(net, optimizer, 0, 10)
    checkpoint, rng = saved(net, optimizer), torch.get_rng_state()
    assert all(set(group) == plain_keys and group["fused"] is None for group in checkpoint[1]["param_groups"])
    assert all(torch.is_tensor(state["step"]) for state in checkpoint[1]["state"].values() if "step" in state)
    assert all(float(state["step"]) == 10 for state in checkpoint[1]["state"].values() if "step" in state)
    assert all(set(group) == plain_keys for group in optimizer.param_groups)  # the user's view too
    autogaudi.disable()
    net, optimizer = resume(make, checkpoint, rng)
    torch.testing.assert_close(first + run(net, optimizer, 10, 20), reference, **close)
    assert optimizer.defaults["fused"] is None

    # Written by plain PyTorch, read under autogaudi.
    net = model()
    optimizer = make(net)
    first = run(net, optimizer, 0, 10)
    checkpoint, rng = saved(net, optimizer), torch.get_rng_state()
    enable(backend)
    net, optimizer = resume(make, checkpoint, rng)
    torch.testing.assert_close(first + run(net, optimizer, 10, 20), reference, **close)
    assert autogaudi.report().unit("fused_optimizer")["figures"]["optimizers_fused"] == 1
    # the step count went on from the checkpoint's: 10 there, 20 now
    assert all(float(state["step"]) == 20 for state in optimizer.state_dict()["state"].values() if "step" in state)


def test_explicit_choices_and_subclasses_are_left_alone(backend):
    enable(backend)
    net = model()

    class MyAdamW(torch.optim.AdamW):
        pass

    explicit = torch.optim.AdamW(net.parameters(), foreach=False)
    mine = MyAdamW(net.parameters())
    assert explicit.defaults["foreach"] is False and explicit.defaults["fused"] is None
    assert mine.defaults["fused"] is None
    row = autogaudi.report().unit("fused_optimizer")
    assert row["figures"] == {"optimizers_fused": 0, "optimizers_kept": 1}
    assert said(row) == [
        ("optimizer_kept", {"optimizer": "AdamW", "why": "the script chose foreach=False", "refusal": None})
    ]


def test_hpu_unsupported_arguments_keep_torchs_optimizer(hpu_double):
    calls = hpu_double(lazy=True)
    enable("hpu")
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), amsgrad=True)
    net(torch.randn(2, 10)).sum().backward()
    optimizer.step()
    assert "FusedAdamW.step" not in calls.names()
    ((code, params),) = said(autogaudi.report().unit("fused_optimizer"))
    assert (code, params["optimizer"]) == ("optimizer_kept", "AdamW") and "amsgrad=True" in params["why"]


def test_user_constructor_errors_are_torchs_own(backend):
    enable(backend)
    with pytest.raises(ValueError, match="Invalid learning rate: -1"):
        torch.optim.AdamW(model().parameters(), lr=-1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'lr_typo'"):
        torch.optim.SGD(model().parameters(), lr_typo=1)


def test_hpu_kernel_failure_at_run_time_reverts_and_training_goes_on(hpu_double, monkeypatch, capsys):
    hpu_double(lazy=True)
    plain, plain_net, _ = train(OPTIMIZERS["adamw"], steps=6)
    enable("hpu")
    from habana_frameworks.torch.hpex import optimizers

    def broken_step(self, closure=None):
        raise RuntimeError("injected kernel failure")

    monkeypatch.setattr(optimizers.FusedAdamW, "step", broken_step)
    losses, net, optimizer = train(OPTIMIZERS["adamw"], steps=6)
    torch.testing.assert_close(losses, plain, **TOLERANCE)
    torch.testing.assert_close(list(net.parameters()), list(plain_net.parameters()), **TOLERANCE)
    row = autogaudi.report().unit("fused_optimizer")
    assert (row["status"], row["reason_code"]) == ("failed", "failed_at_run_time")
    assert "injected kernel failure" in row["reason_params"]["error"]
    assert all(torch.is_tensor(state["step"]) for state in optimizer.state.values())  # torch's format again
    assert "fused_optimizer raised RuntimeError('injected kernel failure')" in capsys.readouterr().err


def test_closure_exceptions_are_the_users(backend):
    enable(backend)
    optimizer = torch.optim.SGD(model().parameters(), lr=0.1)

    def closure():
        raise KeyError("from the user's closure")

    with pytest.raises(KeyError, match="from the user's closure"):
        optimizer.step(closure)
    # on the CPU the update is still being timed (the closure raised before any step)
    assert autogaudi.report().unit("fused_optimizer")["status"] == ("deciding" if backend == "cpu" else "applied")


def sparse_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.ModuleDict({"embedding": torch.nn.Embedding(20, 6, sparse=True), "head": torch.nn.Linear(6, 3)})


def train_sparse(use_closure=False, steps=5):
    """An embedding with sparse gradients under SGD (torch's fused SGD refuses them at its step), the
    step through a closure or not; beside it a dense model of its own under AdamW."""
    net, side = sparse_model(), torch.nn.Linear(4, 1)
    sparse = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    dense = torch.optim.AdamW(side.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(3)
    for _ in range(steps):
        tokens, labels = torch.randint(0, 20, (8,), generator=generator), torch.randint(0, 3, (8,), generator=generator)
        inputs = torch.randn(8, 4, generator=generator)

        def closure(tokens=tokens, labels=labels, inputs=inputs):
            sparse.zero_grad()
            dense.zero_grad()
            loss = torch.nn.functional.cross_entropy(net["head"](net["embedding"](tokens)), labels)
            (loss + side(inputs).pow(2).mean()).backward()
            return loss

        if use_closure:
            sparse.step(closure)
        else:
            closure()
            sparse.step()
        dense.step()
    return net, side


@pytest.mark.parametrize("use_closure", [False, True], ids=["step", "closure"])
def test_sparse_gradients_step_unfused_exactly_as_plain_and_the_rest_stays_fused(backend, use_closure, untimed):
    plain, plain_side = train_sparse(use_closure)
    enable(backend)
    tuned, tuned_side = train_sparse(use_closure)  # torch's fused SGD would raise at the first step
    assert all(map(torch.equal, tuned.parameters(), plain.parameters()))  # torch's own unfused step
    torch.testing.assert_close(list(tuned_side.parameters()), list(plain_side.parameters()), **TOLERANCE)
    row = autogaudi.report().unit("fused_optimizer")
    assert counts(row) == {"optimizers_fused": 1, "optimizers_kept": 1, "kernel_refusals": {"sparse_gradients": 1}}
    assert [(code, params["optimizer"], params["refusal"]) for code, params in said(row)] == [
        ("optimizer_unfused", "SGD", "sparse_gradients")
    ]


def complex_parameter():
    torch.manual_seed(0)
    return torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))


def fit(optimizer, parameters, steps=3):
    for _ in range(steps):
        sum((parameter.abs() ** 2).sum() for parameter in parameters).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_tensors_the_kernel_refuses_keep_the_optimizer_unfused_built_or_added_later():
    """torch builds a fused optimizer over complex parameters and raises at its first step."""
    enable("cpu")
    built_with = complex_parameter()
    fit(torch.optim.Adam([built_with]), [built_with])
    net = model()
    added_later = complex_parameter()
    optimizer = torch.optim.Adam(net.parameters())
    optimizer.add_param_group({"params": [added_later]})
    fit(optimizer, [added_later])
    row = autogaudi.report().unit("fused_optimizer")
    assert row["figures"] == {"optimizers_fused": 0, "optimizers_kept": 2, "kernel_refusals": {"parameter_dtype": 2}}
    assert [(code, params["optimizer"], params["refusal"]) for code, params in said(row)] == [
        ("optimizer_kept", "Adam", "parameter_dtype"),  # built with it
        ("optimizer_unfused", "Adam", "parameter_dtype"),  # added later
    ]
    autogaudi.disable()
    for tuned in (built_with, added_later):
        plain = complex_parameter()
        fit(torch.optim.Adam([plain]), [plain])
        assert torch.equal(tuned, plain)


def test_a_fused_group_that_raises_runs_unfused_with_the_groups_after_it_once(monkeypatch, untimed):
    """The safety net: a group torch's fused step raised on (having checked it, it updated nothing)
    takes torch's unfused step; the groups before it, done fused, are not stepped twice."""
    make = OPTIMIZERS["per_group"]
    plain, plain_net, _ = train(make, steps=3)
    enable("cpu")
    kernel = torch._fused_adamw_
    seen = []

    def second_group_refused(*args, **kwargs):
        seen.append(len(args[0]))
        if len(seen) == 2:
            raise RuntimeError("injected refusal")
        return kernel(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adamw_", second_group_refused)
    losses, net, optimizer = train(make, steps=3)
    assert seen == [2, 2]  # both groups tried fused once, then unfused for good
    torch.testing.assert_close(losses, plain, **TOLERANCE)
    torch.testing.assert_close(list(net.parameters()), list(plain_net.parameters()), **TOLERANCE)
    row = autogaudi.report().unit("fused_optimizer")
    assert (row["reason_code"], row["figures"]["kernel_refusals"]) == ("torch_fused", {"fused_step_raised": 1})


def test_after_disable_its_optimizers_are_plain(monkeypatch):
    enable("cpu")
    net = sparse_model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    autogaudi.disable()
    calls = counting(monkeypatch, "_fused_sgd_")
    net["head"](net["embedding"](torch.tensor([1, 2]))).sum().backward()
    optimizer.step()  # sparse gradients: a fused step would raise
    assert calls == []


def autogaudi_objects(root) -> list:
    """What of autogaudi's is reachable from ``root`` through references (modules and classes,
    shared by every object, are not followed)."""
    seen, stack, found = set(), [root], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType)):
            continue
        seen.add(id(obj))
        module = getattr(obj, "__module__", None) if callable(obj) else type(obj).__module__
        if isinstance(module, str) and module.startswith("autogaudi"):
            found.append(obj)
        if not isinstance(obj, (types.FunctionType, types.BuiltinFunctionType)):  # not into their globals
            stack.extend(gc.get_referents(obj))
    return found


@pytest.mark.parametrize("name", ["adamw", "sgd_momentum"])
def test_copies_and_pickles_are_plain_optimizers_that_continue_training(backend, name):
    make = OPTIMIZERS[name]
    net = model()
    reference = run(net, make(net), 0, 20)  # plain PyTorch, uninterrupted
    enable(backend)
    net = model()
    optimizer = make(net)
    first = run(net, optimizer, 0, 10)
    rng = torch.get_rng_state()
    pickled = pickle.dumps((net, optimizer))
    assert b"autogaudi" not in pickled  # unpickling needs nothing of autogaudi's
    copied_net, copied = copy.deepcopy((net, optimizer))
    assert autogaudi_objects(copied) == []
    assert all(group["fused"] is None for group in copied.param_groups) and copied.defaults["fused"] is None
    autogaudi.disable()
    for net, optimizer in (pickle.loads(pickled), (copied_net, copied)):
        torch.set_rng_state(rng)
        torch.testing.assert_close(first + run(net, optimizer, 10, 20), reference, **tolerance(backend, name))


def test_fsdp2_dtensor_parameters_fuse_under_adamw_not_under_sgd(process_group, untimed):
    """FSDP2's DTensor parameters: DTensor has sharding rules for torch's fused Adam/AdamW kernels,
    none for _fused_sgd_ (torch 2.13 raises NotImplementedError at the step)."""
    from torch.distributed.fsdp import fully_shard

    def sharded():
        net = model()
        fully_shard(net)
        return net

    plain, plain_net, _ = train(lambda net: torch.optim.AdamW(fully_shard(net).parameters(), lr=3e-3), steps=3)
    enable("cpu")
    adamw_net = sharded()
    adamw = torch.optim.AdamW(adamw_net.parameters(), lr=3e-3)
    sgd_net = sharded()
    sgd = torch.optim.SGD(sgd_net.parameters(), lr=0.1)
    for net, optimizer in ((adamw_net, adamw), (sgd_net, sgd)):
        net(torch.randn(4, 10)).sum().backward()
        optimizer.step()
    row = autogaudi.report().unit("fused_optimizer")
    assert counts(row) == {"optimizers_fused": 1, "optimizers_kept": 1, "kernel_refusals": {"dtensor_parameters": 1}}
    assert [(code, params["optimizer"], params.get("refusal")) for code, params in said(row)] == [
        ("optimizer_kept", "SGD", "dtensor_parameters"),
        ("rounding_not_measured_dtensor", "AdamW", None),  # a comparison of DTensors would be a collective
    ]
    assert row["numerics_measured"] is None
    losses, net, _ = train(lambda net: torch.optim.AdamW(fully_shard(net).parameters(), lr=3e-3), steps=3)
    torch.testing.assert_close(losses, plain, **TOLERANCE)


def test_the_first_fused_steps_are_measured_against_torchs_unfused_step_on_copies(monkeypatch, untimed):
    """The rounding the report gives: each of the first steps beside torch's own unfused step from
    the same state, on copies. Measuring changes nothing: the parameters are those of a run whose
    steps are not measured, bit for bit."""
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer

    measured_steps = fused_optimizer.MEASURED_STEPS
    monkeypatch.setattr(fused_optimizer, "MEASURED_STEPS", 0)
    enable("cpu")
    _, unmeasured, _ = train(OPTIMIZERS["adamw"], steps=6)
    assert "numerics_measured" not in autogaudi.report().unit("fused_optimizer")["figures"]
    autogaudi.disable()
    monkeypatch.setattr(fused_optimizer, "MEASURED_STEPS", measured_steps)
    enable("cpu")
    _, measured, _ = train(OPTIMIZERS["adamw"], steps=6)
    assert all(map(torch.equal, measured.parameters(), unmeasured.parameters()))
    row = autogaudi.report().unit("fused_optimizer")
    figure = row["numerics_measured"]
    assert figure == row["figures"]["numerics_measured"]
    assert (figure["of"], figure["steps"]) == ("parameters", fused_optimizer.MEASURED_STEPS)
    # rounding: the last bits of a float32 parameter, or none (on some CPUs torch's fused and unfused
    # AdamW kernels round these six steps the same way)
    assert 0 <= figure["max_rel_diff"] < 1e-5
    assert autogaudi.report().numerics() == [{"unit": "fused_optimizer", "how": ["rounding"], "measured": figure}]


def test_parameters_other_processes_update_are_neither_compared_nor_timed_and_stay_fused():
    """Hogwild: the parameters are in shared memory and other processes write them during the step,
    so a comparison against a copy would count their writes as rounding."""

    def shared_adam(net):
        net.share_memory()
        return torch.optim.Adam(net.parameters(), lr=3e-3)

    autogaudi.enable(device="cpu", only="fused_optimizer")  # the defaults: no timing chooses it here
    train(shared_adam, steps=20)  # past the steps a timing would take
    row = autogaudi.report().unit("fused_optimizer")
    assert row["numerics"] == ["rounding"] and row["numerics_measured"] is None
    assert [code for code, _ in said(row)] == ["rounding_not_measured_shared"]
    assert row["status"] == "applied" and "update_ms" not in row["figures"]


def test_with_several_ranks_the_update_is_not_timed_so_no_rank_decides_alone(monkeypatch):
    """Each rank timing its own update could put one back and keep another fused: DDP's replicas
    would then be updated by different kernels and drift apart."""
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer

    monkeypatch.setattr(fused_optimizer, "several_ranks", lambda: True)
    enable("cpu")
    train(OPTIMIZERS["adamw"], steps=20)  # past the steps a timing would take
    row = autogaudi.report().unit("fused_optimizer")
    assert row["status"] == "applied" and "update_ms" not in row["figures"]
    assert "not_timed_several_ranks" in [code for code, _ in said(row)]
    assert row["numerics_measured"]["steps"] == fused_optimizer.MEASURED_STEPS  # the rounding still measured


def test_rounding_is_not_measured_where_a_copy_would_not_fit(monkeypatch):
    from autogaudi.measure import numerics

    monkeypatch.setattr(numerics, "free_bytes", lambda backend, device: 1024)
    enable("cpu")
    train(OPTIMIZERS["adam"], steps=3)
    row = autogaudi.report().unit("fused_optimizer")
    assert row["numerics"] == ["rounding"] and row["numerics_measured"] is None
    assert [code for code, _ in said(row)] == ["rounding_not_measured_memory"]


def test_on_the_hpu_double_the_hpex_step_is_measured_against_torchs(hpu_double):
    hpu_double(lazy=True)
    enable("hpu")
    train(OPTIMIZERS["adamw"], steps=4)
    figure = autogaudi.report().unit("fused_optimizer")["numerics_measured"]
    # the bridge's FusedAdamW adds eps to the uncorrected sqrt(v): more than rounding in the first steps
    assert figure["steps"] == 3 and 0 < figure["max_rel_diff"] < 1e-3


def timed_updates(monkeypatch, clock, fused_ms, unfused_ms, cls=torch.optim.AdamW):
    """``cls``'s update (torch's, inside its hook layer) taking ``fused_ms`` or ``unfused_ms`` on the
    test's clock (a list: the i-th such update takes the i-th value, cycled). Patched before enable()."""
    cls([torch.zeros(1)], lr=0.1)  # torch puts its hook layer on the class's step in the first __init__
    raw_step = cls.step.__wrapped__
    calls = {True: 0, False: 0}
    given = {True: fused_ms, False: unfused_ms if isinstance(unfused_ms, list) else [unfused_ms]}

    def update(optimizer, *args, **kwargs):
        result = raw_step(optimizer, *args, **kwargs)
        fused = any(group.get("fused") for group in optimizer.param_groups)
        clock.advance(given[fused][calls[fused] % len(given[fused])] / 1000)
        calls[fused] += 1
        return result

    monkeypatch.setattr(cls.step, "__wrapped__", update)


def counted_copies(monkeypatch):
    """Calls of numerics.unfused_update: each copies the optimizer's tensors for torch's update."""
    from autogaudi.measure import numerics

    calls = []
    original = numerics.unfused_update
    monkeypatch.setattr(numerics, "unfused_update", lambda *args: calls.append(1) or original(*args))
    return calls


def test_the_update_is_timed_against_torchs_and_the_report_gives_its_effect(monkeypatch, step_clock):
    """On a backend whose host waits for each op, the steps after the first time the update alone:
    the run's own unfused update (here 2 ms on the test's clock) against the fused one on copies (no
    time); decided after TIMED_STEPS of them, fused from the next step on, no more copies made."""
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer

    timed_updates(monkeypatch, step_clock, fused_ms=[0.0], unfused_ms=2.0)
    copies = counted_copies(monkeypatch)
    enable("cpu")
    calls = counting(monkeypatch, "_fused_adamw_")
    steps = 1 + fused_optimizer.TIMED_STEPS + 4
    train(OPTIMIZERS["adamw"], steps=steps)
    report = autogaudi.report()
    row = report.unit("fused_optimizer")
    assert row["figures"]["update_ms"] == {"unfused": 2.0, "fused": 0.0, "steps": fused_optimizer.TIMED_STEPS}
    assert row["figures"]["optimizers_fused"] == 1 and row["reason_code"] == "torch_fused"
    assert len(copies) == 1 + fused_optimizer.TIMED_STEPS  # the first step (rounding only), then the timed ones
    assert len(calls) == steps  # fused on copies while timed, then the run's own 4 steps
    assert row["numerics_measured"]["steps"] == fused_optimizer.MEASURED_STEPS
    (change,) = report.summary()["changed"]
    effect = change["effect"]
    assert effect["ms_per_step_without"] == pytest.approx(effect["ms_per_step_with"] + 2.0, abs=1e-3)
    assert effect["saved_s"] == pytest.approx(0.002 * 4) and effect["one_off_s"] == 0.0


# The trials' rule on the medians: kept only where the fused update is at least trials.MARGIN (3%)
# faster, beyond the arms' spread, by a gain material to the step; a tie, or a gain within the
# margin, keeps torch's. Outliers in fewer than half the steps (a preemption on a busy machine) do
# not move a median. Decided after TIMED_STEPS timed updates, however far apart they are.
@pytest.mark.parametrize(
    "fused_ms, kept",
    [
        ([1.5], False),  # slower
        ([1.0], False),  # a tie
        ([0.98], False),  # faster by less than the margin
        ([0.9], True),  # faster by more than the margin (and by 5% of the ~1.9 ms step)
        ([0.5, 9.0, 0.5], True),  # faster, a third of the fused updates preempted
        ([1.5, 0.1, 1.5], False),  # slower, a third of them oddly fast
    ],
)
def test_the_fused_update_is_kept_only_where_the_trials_rule_finds_it_faster(monkeypatch, step_clock, fused_ms, kept):
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer

    timed_updates(monkeypatch, step_clock, fused_ms=fused_ms, unfused_ms=1.0)
    enable("cpu")
    calls = counting(monkeypatch, "_fused_adamw_")
    decided, more = 1 + fused_optimizer.TIMED_STEPS, 3
    train(OPTIMIZERS["adamw"], steps=decided + more)
    row = autogaudi.report().unit("fused_optimizer")
    assert len(calls) == decided + (more if kept else 0)  # on copies while timed, then the run's own
    assert row["figures"]["update_ms"]["steps"] == fused_optimizer.TIMED_STEPS
    assert row["figures"]["optimizers_fused"] == (1 if kept else 0)
    assert [code for code, _ in said(row)] == ([] if kept else ["fused_slower"])
    assert row["reason_code"] == ("torch_fused" if kept else "fused_slower")
    assert row["numerics"] == (["rounding"] if kept else [])  # not kept: the run never ran it


# A unit that changes the run's numbers keeps them changed only for a gain that matters: the fused
# update must save at least trials.MATERIAL (5%) of the training step, and more than the two
# arms' spread (their median absolute deviations added). The step's own work is the test's clock.
@pytest.mark.parametrize(
    "fused_ms, step_ms, kept",
    [
        ([0.8], 0.0, True),  # 0.2 ms saved of a ~1.8 ms step: 11%
        ([0.96], 0.0, False),  # 0.04 ms saved of a ~2 ms step: 2%, under 5%
        ([0.96], 1000.0, False),  # 0.04 ms saved of a 1 s step: far under
        ([0.5], 5.0, True),  # 0.5 ms of a ~6.5 ms step: above 5%
        ([0.5], 10.0, False),  # 0.5 ms of a ~11.5 ms step: under 5%
        ([0.5, 1.2], 0.0, False),  # faster on the medians (0.85 ms), but by less than the fused arm's spread
    ],
)
def test_a_faster_fused_update_is_kept_only_where_its_gain_is_material_to_the_step(
    monkeypatch, step_clock, fused_ms, step_ms, kept
):
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer

    timed_updates(monkeypatch, step_clock, fused_ms=fused_ms, unfused_ms=1.0)
    enable("cpu")
    calls = counting(monkeypatch, "_fused_adamw_")
    net = model()
    optimizer = OPTIMIZERS["adamw"](net)
    decided, more = 1 + fused_optimizer.TIMED_STEPS, 3
    for _ in range(decided + more):
        step_clock.advance(step_ms / 1000)
        net(torch.randn(8, 10)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    row = autogaudi.report().unit("fused_optimizer")
    assert row["figures"]["optimizers_fused"] == (1 if kept else 0)
    assert row["reason_code"] == ("torch_fused" if kept else "gain_not_material")
    assert [code for code, _ in said(row)] == ([] if kept else ["gain_not_material"])
    assert len(calls) == decided + (more if kept else 0)  # not kept: only the copies ever ran fused
    assert row["numerics"] == (["rounding"] if kept else [])


def test_why_not_fused_weighs_the_medians_gain_against_the_step_and_the_spread():
    from autogaudi.optimizations.fused_optimizer.update_times import UpdateTimes, why_not_fused

    times = UpdateTimes(unfused=[0.010] * 4, fused=[0.008] * 4)  # 2 ms saved, no spread
    assert why_not_fused(times, step_s=0.04) is None  # 5% of the step exactly
    under = {"gain": 2.0, "step": 41.0, "share": 0.05, "spread": 0.0}
    assert why_not_fused(times, step_s=0.041) == ("gain_not_material", under)
    assert why_not_fused(times, step_s=None)[0] == "gain_not_material"  # no step measured: not shown material
    noisy = UpdateTimes(unfused=[0.010, 0.013, 0.010, 0.013], fused=[0.008, 0.011, 0.008, 0.011])
    assert why_not_fused(noisy, step_s=0.05)[1]["spread"] == 3.0  # 2 ms saved, 1.5 + 1.5 ms spread
    stray = UpdateTimes(unfused=[0.010, 0.0105] * 2, fused=[0.008, 0.0085] * 2)  # 2 ms, 0.25 + 0.25 ms spread
    assert why_not_fused(stray, step_s=0.04) is None
    outliers = UpdateTimes(unfused=[0.010] * 4, fused=[0.008, 0.008, 0.008, 0.5])  # one preempted
    assert why_not_fused(outliers, step_s=0.04) is None
    slower = UpdateTimes(unfused=[0.010] * 4, fused=[0.0099] * 4)  # 1% faster: under the margin
    assert why_not_fused(slower, step_s=0.001) == ("fused_slower", {"fused": 9.9, "unfused": 10.0})


def quiet_and_noisy(base_ms: float, seed: int, noisy: bool) -> list:
    """Times about ``base_ms``, one for each step until decided: quiet (0.5% jitter) or noisy (a busy
    machine: 30% jitter, every third one preempted 20x)."""
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer

    generator = torch.Generator().manual_seed(seed)
    jitter = torch.rand(1 + fused_optimizer.TIMED_STEPS, generator=generator).tolist()
    times = [base_ms * (1 + (0.3 if noisy else 0.005) * (2 * value - 1)) for value in jitter]
    return [value * 20 if noisy and index % 3 == 2 else value for index, value in enumerate(times)]


@pytest.mark.parametrize(
    "fused_ms, unfused_ms, step_ms, kept",
    [(0.087, 0.165, 43.0, False), (0.95, 1.0, 3.0, False), (0.3, 1.0, 3.0, True)],
    ids=["actor_critic_0.2pct_of_the_step", "5pct_of_the_update", "a_fifth_of_the_step"],
)
@pytest.mark.parametrize("seed", range(3))
def test_the_decision_and_its_step_are_the_same_on_quiet_and_on_noisy_timings(
    monkeypatch, step_clock, fused_ms, unfused_ms, step_ms, kept, seed
):
    """A gain that is no gain for the run (0.08 ms of a 43 ms step, as pytorch/examples'
    actor-critic measured) keeps torch's update on a quiet machine and on a busy one; a large one is
    kept on both, switched at the same step: the run's numbers do not hang on the load."""
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer

    decisions = []
    for noisy in (False, True):
        patch = monkeypatch.context()
        patched = patch.__enter__()
        timed_updates(
            patched,
            step_clock,
            fused_ms=quiet_and_noisy(fused_ms, seed, noisy),
            unfused_ms=quiet_and_noisy(unfused_ms, seed + 100, noisy),
        )
        steps_ms = quiet_and_noisy(step_ms, seed + 200, noisy)
        enable("cpu")
        calls = counting(patched, "_fused_adamw_")
        net = model()
        optimizer = OPTIMIZERS["adamw"](net)
        for step in range(1 + fused_optimizer.TIMED_STEPS + 2):
            step_clock.advance(steps_ms[step % len(steps_ms)] / 1000)
            net(torch.randn(8, 10)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        row = autogaudi.report().unit("fused_optimizer")
        decisions.append((row["figures"]["optimizers_fused"], len(calls), row["numerics"]))
        autogaudi.disable()
        patch.__exit__(None, None, None)
    decided = 1 + fused_optimizer.TIMED_STEPS  # the copies' fused updates; then the run's own, if kept
    expected = (1, decided + 2, ["rounding"]) if kept else (0, decided, [])
    assert decisions == [expected, expected]


def test_the_runs_steady_state_starts_once_the_update_is_decided(monkeypatch, step_clock):
    """A decision that changes the run's steps (and whose timed steps make copies): no trial and no
    census step times the steps the update is timed in; the run settles once both are done."""
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer
    from autogaudi.optimizations.step_profiler import classification

    timed_updates(monkeypatch, step_clock, fused_ms=[0.0], unfused_ms=2.0)
    autogaudi.enable(device="cpu", only="step_profiler,fused_optimizer", warmup_steps=1, trial="fused_optimizer")
    net = model()
    optimizer = OPTIMIZERS["adamw"](net)
    settled, trials_wait = [], []
    for _ in range(1 + fused_optimizer.TIMED_STEPS + 2 + 2 * classification.PAIRS):
        step_clock.advance(0.010)  # the step's own work, so the census has a step to set its ops against
        net(torch.randn(8, 10)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        settled.append(autogaudi.settled())
        windows = runtime._STATE.session.windows
        trials_wait.append(windows.holder is not None and windows.holder_name() == "fused_optimizer")
    decided = fused_optimizer.TIMED_STEPS  # timed in the steps after the first: decided in step 1 + 12
    assert trials_wait == [True] * decided + [False] * (len(trials_wait) - decided), trials_wait
    profiled_at = autogaudi.report().unit("step_profiler")["figures"]["profiled_at_step"]
    assert profiled_at > 1 + decided  # the census began once the update was decided
    assert settled.index(True) == profiled_at - 1, settled
    assert autogaudi.report().steps["decisions_settled_at_step"] == profiled_at


@pytest.mark.parametrize(
    "name, default_dtype",
    [("adamw", torch.float32), ("adamw", torch.float64), ("adam", torch.float64), ("sgd_momentum", torch.float32)],
)
def test_an_optimizer_put_back_continues_as_the_script_built_it_bitwise(monkeypatch, step_clock, name, default_dtype):
    """Not fused after its timed steps: those steps ran torch's own update (the fused one only on
    copies), so its parameters are plain's bit for bit, its defaults and groups the script's, its step
    counters where torch's unfused Adam/AdamW keeps them (the CPU, the default float dtype), and its
    later steps those of a plain optimizer loaded from the same state. The report keeps the measured
    figures, and names no change to the run's numbers."""
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer

    previous = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        decided, more = 1 + fused_optimizer.TIMED_STEPS, 5
        generator = torch.Generator().manual_seed(1)
        batches = [
            (torch.randn(8, 10, generator=generator), torch.randint(0, 3, (8,), generator=generator))
            for _ in range(decided + more)
        ]

        plain_net = model()
        plain = OPTIMIZERS[name](plain_net)
        plain_losses = train_on(plain_net, plain, batches[:decided])

        timed_updates(monkeypatch, step_clock, fused_ms=[2.0], unfused_ms=1.0, cls=type(plain))
        enable("cpu")
        net = model()
        optimizer = OPTIMIZERS[name](net)
        assert train_on(net, optimizer, batches[:decided]) == plain_losses
        assert all(map(torch.equal, net.parameters(), plain_net.parameters()))
        assert optimizer.defaults == plain.defaults
        assert [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups] == [
            {k: v for k, v in group.items() if k != "params"} for group in plain.param_groups
        ]
        for param, plain_param in zip(net.parameters(), plain_net.parameters()):
            state, plain_state = optimizer.state[param], plain.state[plain_param]
            assert {key: (value.dtype, value.device) for key, value in state.items()} == {
                key: (value.dtype, value.device) for key, value in plain_state.items()
            }
            assert float(state.get("step", 0)) == float(plain_state.get("step", 0))
        state = copy.deepcopy((net.state_dict(), optimizer.state_dict())), torch.get_rng_state()  # dropout's
        losses = train_on(net, optimizer, batches[decided:])
        row = autogaudi.report().unit("fused_optimizer")
        assert row["figures"]["update_ms"] == {"unfused": 1.0, "fused": 2.0, "steps": fused_optimizer.TIMED_STEPS}
        assert row["figures"]["optimizers_put_back"] == 1 and row["changes"] == [] and row["status"] == "not needed"
        assert row["reason_code"] == "fused_slower" and row["numerics"] == []
        assert row["figures"]["numerics_measured"]["steps"] == fused_optimizer.MEASURED_STEPS  # on the copies
        assert autogaudi.report().summary()["changed"] == []
        autogaudi.disable()

        resumed_net = model()
        resumed_net.load_state_dict(state[0][0])
        resumed = OPTIMIZERS[name](resumed_net)
        resumed.load_state_dict(state[0][1])
        torch.set_rng_state(state[1])
        assert train_on(resumed_net, resumed, batches[decided:]) == losses
        assert all(map(torch.equal, net.parameters(), resumed_net.parameters()))
    finally:
        torch.set_default_dtype(previous)


def test_where_the_host_runs_ahead_the_update_is_not_timed(hpu_double, monkeypatch):
    """The HPU double queues ahead of the device: timing would need a synchronisation. The fused
    update stays, and only the first steps' rounding takes copies."""
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer

    hpu_double(lazy=True)
    copies = counted_copies(monkeypatch)
    enable("hpu")
    train(OPTIMIZERS["adamw"], steps=1 + fused_optimizer.TIMED_STEPS + 2)
    row = autogaudi.report().unit("fused_optimizer")
    assert "update_ms" not in row["figures"] and row["figures"]["optimizers_fused"] == 1
    assert len(copies) == fused_optimizer.MEASURED_STEPS


@pytest.mark.parametrize("remembered, fused", [("kept", True), ("rejected", False)])
def test_a_warm_run_takes_the_remembered_decision_at_the_step_the_first_run_took_it(
    monkeypatch, step_clock, remembered, fused
):
    """A run with the same set-up, model and inputs follows what the first one timed, whatever its own
    timings would say (here the opposite), and switches where the first did: after the optimizer's
    first step and its TIMED_STEPS timed ones, so both runs' numbers are the same. It times nothing."""
    from autogaudi.optimizations.fused_optimizer import unit as fused_optimizer

    record = {"decision": remembered, "speedup": 1.9, "run": 1, "date": "2026-11-28"}
    from autogaudi.core.run_view import RunView

    monkeypatch.setattr(RunView, "recalled_trial", lambda run, name: record if name == "fused_optimizer" else None)
    timed_updates(monkeypatch, step_clock, fused_ms=[0.5 if remembered == "rejected" else 2.0], unfused_ms=1.0)
    copies = counted_copies(monkeypatch)
    enable("cpu")
    calls = counting(monkeypatch, "_fused_adamw_")
    decided, more = 1 + fused_optimizer.TIMED_STEPS, 3
    train(OPTIMIZERS["adamw"], steps=decided + more)
    row = autogaudi.report().unit("fused_optimizer")
    assert len(calls) == (more if fused else 0)
    # no copy while deciding; once fused, its first steps' rounding is measured against torch's
    assert len(copies) == (min(more, fused_optimizer.MEASURED_STEPS) if fused else 0)
    assert row["reason_code"] == "remembered_timing" and row["figures"]["optimizers_fused"] == int(fused)
    assert "update_ms" not in row["figures"]


def test_an_lr_scheduler_built_after_the_optimizer_leaves_its_step_on_the_units_route(monkeypatch, untimed):
    """torch's LR schedulers rebind ``optimizer.step`` through its ``__func__``: the fused kernel still
    runs every step (it once stepped around the unit, which then reported it fused all the same)."""
    adam = sys.modules["torch.optim.adam"]  # the attribute torch.optim.adam is the function
    fused_steps = []
    kernel = adam._fused_adam
    monkeypatch.setattr(adam, "_fused_adam", lambda *a, **k: fused_steps.append(1) or kernel(*a, **k))
    enable("cpu")
    net = model()
    optimizer = OPTIMIZERS["adamw"](net)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    for _ in range(3):
        net(torch.randn(8, 10)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    assert len(fused_steps) == 3
    assert autogaudi.report().unit("fused_optimizer")["figures"]["optimizers_fused"] == 1
