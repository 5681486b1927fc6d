"""What a unit must never break, in every state it can be in, generated from the registry.

For every unit x every state it declares (``Unit.spec.states``) x every operation a script does with its
objects, the outcome is plain PyTorch's: ``torch.save(model)`` loads back as a plain model,
``pickle`` and ``copy.deepcopy`` give plain objects that hold nothing of autogaudi's,
``state_dict()`` loads into a plain model and optimizer, ``autograd.grad(create_graph=True)``,
``torch.utils.checkpoint`` and the script's own ``torch.compile`` give plain's numbers, a
``KeyboardInterrupt`` raised in the script's code reaches the script as it was, what the script
drops dies when it drops it (as plain's does, without waiting for the garbage collector), and a checkpoint
taken in that state resumes in plain PyTorch on the loss curve an uninterrupted plain run draws.
Each cell first asserts that the unit is in the state it names, as the unit's report row shows it.

A new unit is covered without a row written for it: it declares its states (a base class's by
default) and the recipes below drive any unit into each. Trials are decided by the test (kept or
rejected as the state says) on a clock the test moves, and every measurement of the steps (the
profile, loader_workers' waits) on another, so each cell takes the same decisions whatever the
machine's load; captures are identity graphs (the real compiler's copies and saves are tested in
tests/optimizations/test_capture_safety.py), so the matrix stays cheap enough to run in full in CI.
"""

import copy
import importlib
import io
import pickle
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

import autogaudi
from autogaudi.backends.cpu import CpuBackend
from autogaudi.core.registry import UNITS
from autogaudi.core.status import Status
from autogaudi.entry import runtime
from autogaudi.measure import trials
from autogaudi.optimizations import step_profiler
from tests.helpers import SWITCHED_ON_BY, TRIAL_BY, collector_off

RESUMED_STEPS = 3
MAX_STEPS = 120  # a state not reached by then fails the test
# How far numbers may be from plain's (relative and absolute): float reassociation (fused kernels,
# channels_last), and bf16's 8 significant bits where the model runs in it.
TOLERANCE = {"default": 1e-4, "mixed_precision": 5e-2}


class ContractNet(nn.Module):
    """Small, with something for every unit: a convolution and BatchNorm (channels_last), matrix
    products (mixed precision), attention through scaled_dot_product_attention (fused SDPA),
    repeated blocks (activation checkpointing)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.proj = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 3)

    def forward(self, images):
        features = torch.relu(self.norm(self.conv(images)))
        tokens = self.proj(features.flatten(2).transpose(1, 2)).unsqueeze(1)
        attended = F.scaled_dot_product_attention(tokens, tokens, tokens).squeeze(1)
        for block in self.blocks:
            attended = attended + torch.tanh(block(attended))
        return self.head(attended.mean(1))


def unit_class(info):
    module_name, class_name = info.module.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def on_hpu(info) -> bool:
    return "cpu" not in info.backends


def under_ddp(info) -> bool:
    return any("DistributedDataParallel" in target for target in unit_class(info).spec.targets)


CELLS = [(info, state) for info in UNITS for state in unit_class(info).spec.states]

# Each state as the unit's report row shows it: (status, reason code; None: any code).
REACHED = {
    "watching": ("watching", None),
    "checking": ("deciding", "checking"),
    "trial": ("deciding", "trial_running"),
    "kept": ("applied", "measured_faster"),
    "rejected": ("not needed", "rejected"),
    "in_use": ("applied", None),
}
# The cells whose unit, at the named state's point of this script, stands elsewhere, and where: it acts
# before the first step, or the script gives it nothing to change. Said exactly, so a change shows.
STANDS_ELSEWHERE = {
    # declares no in_use (it acts before the bridge loads, done here): its failed and disabled start here
    ("gpu_migration", "in_use"): ("watching", "bridge_loaded_first"),
    ("step_profiler", "watching"): ("deciding", "warming_up"),  # profiles from the first step
    ("step_profiler", "in_use"): ("watching", "host_bound"),  # its profile is what the others act on
    # under the defaults on the CPU: left as built, its timing would choose the numbers (in use: --trial)
    ("fused_optimizer", "watching"): ("watching", "changes_numbers"),
    ("pin_memory", "watching"): ("applied", "pinned"),  # pins the loader at its construction
    ("ddp_tuning", "watching"): ("applied", "bucket_view"),  # tunes DDP at its construction
    ("shape_buckets", "in_use"): ("not needed", "static_shapes"),  # the batches are all one shape
    ("static_last_batch", "in_use"): ("watching", "eager"),  # shapes cost nothing on an eager CPU run
    # the double is started with its mode given (PT_HPU_LAZY_MODE), which hpu_mode never overrides
    ("hpu_mode", "in_use"): ("watching", "set_by_environment"),
    ("throughput_meter", "in_use"): ("watching", "final_only"),  # no --log-every
    ("non_blocking_copy", "in_use"): ("watching", "pinned_to_device"),  # the host stands for the device
}
# In use, said more closely where the status alone would not tell: the reason code, a figure of what it changed.
IN_USE_CODE = {"fused_optimizer": "torch_fused", "loader_workers": "workers"}
IN_USE_FIGURE = {"fused_optimizer": "optimizers_fused", "activation_checkpointing": "blocks_checkpointed"}
# Where a state is reached at another's point: failed and disabled from in use.
REACHED_FROM = {"failed": "in_use", "disabled": "in_use"}


class Waiting(torch.utils.data.TensorDataset):
    """A dataset whose samples take ``wait`` seconds of ``clock`` each to build (a starved loader)."""

    def __init__(self, *tensors, clock=None, wait=0.0):
        super().__init__(*tensors)
        self.clock, self.wait = clock, wait

    def __getitem__(self, index):
        if self.clock is not None:
            self.clock.advance(self.wait)
        return super().__getitem__(index)


class Training:
    """The script: model, AdamW, a scheduler, a DataLoader, clipping; built from a seed, so that a
    plain run and a run under autogaudi start from the same weights and see the same batches.
    ``loader_clock``: each sample waits 2 ms of it (the loader starves the step)."""

    def __init__(self, ddp=False, loader_clock=None):
        torch.manual_seed(0)
        self.model = ContractNet()
        self.inner = self.model
        if ddp:
            self.model = nn.parallel.DistributedDataParallel(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=5, gamma=0.5)
        generator = torch.Generator().manual_seed(1)
        images, labels = torch.randn(64, 3, 8, 8, generator=generator), torch.randint(0, 3, (64,), generator=generator)
        dataset = Waiting(images, labels, clock=loader_clock, wait=0.002)
        self.loader = torch.utils.data.DataLoader(dataset, batch_size=8)
        self.batches = self._batches()
        self.steps = 0

    def _batches(self):
        while True:
            yield from self.loader

    def step(self) -> float:
        images, labels = next(self.batches)
        loss = F.cross_entropy(self.model(images), labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.scheduler.step()
        self.steps += 1
        return loss.item()

    def checkpoint(self) -> dict:
        state = {
            "model": self.inner.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }
        return copy.deepcopy(state)

    def resume(self, checkpoint: dict, steps_done: int) -> None:
        self.inner.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scheduler.load_state_dict(checkpoint["scheduler"])
        for _ in range(steps_done):  # the data stream where the checkpointed run left it
            next(self.batches)
        self.steps = steps_done


def session():
    return runtime._STATE.session


def profiled() -> bool:
    profiler = session().unit("step_profiler")
    return profiler is None or profiler.profile is not None


def trial_decided(name):
    return lambda unit: any(record["candidate"] == name for record in session().trials.records)


def settled_in_use(unit) -> bool:
    """Profiled, every decision made (a precision checked, a trial over), and a few steps since."""
    steps = session().steps
    decided = unit.status() is not Status.DECIDING
    return profiled() and session().trials.idle and decided and steps.steps >= steps.options.warmup_steps + 12


# state -> (options for the unit called name, whether the unit is there: a predicate on the live unit)
def recipe(name: str, state: str):
    # what puts each in use: capture and memory format forced, the fused update asked for (timed, on the CPU)
    base = {"force": name} if name in ("graph_capture", "channels_last") else {}
    base = {"trial": name} if name == "fused_optimizer" else base
    in_use = {
        "watching": ({}, lambda unit: True),
        "in_use": (base, settled_in_use),
        "checking": ({}, lambda unit: unit.status() is Status.DECIDING and not session().trials.pending(unit)),
        "trial": (TRIAL_BY.get(name, {"trial": name}), lambda unit: session().trials.pending(unit)),
    }
    if state in in_use:
        return in_use[state]
    if state in ("kept", "rejected"):
        return TRIAL_BY.get(name, {"trial": name}), trial_decided(name)
    if state in ("failed", "disabled"):
        return recipe(name, "in_use")
    raise AssertionError(f"no recipe for the state {state!r}: add one to tests/test_contract_matrix.py")


def options_for(info, state):
    options, until = recipe(info.name, state)
    only = ["step_profiler", info.name, *unit_class(info).spec.requires]
    enabled = {
        "device": "hpu" if on_hpu(info) else "cpu",
        "warmup_steps": 1,
        "only": ",".join(dict.fromkeys(only)),
        **SWITCHED_ON_BY.get(info.name, {}),
        **options,
    }
    if info.opt_in:
        enabled["force"] = ",".join(dict.fromkeys(filter(None, [*enabled.get("force", "").split(","), info.name])))
    return enabled, until


def free_of_autogaudi(obj, what: str) -> None:
    """Nothing of autogaudi's is reachable from ``obj``: pickling it names no autogaudi module."""
    data = pickle.dumps(obj)
    assert b"autogaudi" not in data, f"{what} pickles autogaudi's objects"


def plain_module(module, what: str) -> None:
    for sub in module.modules():
        assert "_compiled_call_impl" not in vars(sub), f"{what}: a call route travelled"
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks, sub._backward_hooks, sub._backward_pre_hooks):
            assert not hooks, f"{what}: hooks travelled on {type(sub).__name__}"
    free_of_autogaudi(module, what)


def forward_of(module, images):
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            return module(images)
    finally:
        module.train(was_training)


def check_operations(training: Training, images, tolerance: float) -> None:
    model, inner = training.model, training.inner
    expected = forward_of(copy.deepcopy(inner), images)

    buffer = io.BytesIO()
    torch.save(model, buffer)
    assert b"autogaudi" not in buffer.getvalue(), "torch.save(model) wrote autogaudi's objects"
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    plain_module(loaded, "torch.load(torch.save(model))")
    torch.testing.assert_close(forward_of(loaded, images), expected, rtol=1e-4, atol=1e-5)

    for twin, what in ((pickle.loads(pickle.dumps(model)), "pickle"), (copy.deepcopy(model), "deepcopy")):
        plain_module(twin, what)
        torch.testing.assert_close(forward_of(twin, images), expected, rtol=1e-4, atol=1e-5)
    for obj, what in ((training.optimizer, "the optimizer"), (training.scheduler, "the scheduler")):
        free_of_autogaudi(obj, what)
        free_of_autogaudi(copy.deepcopy(obj), f"a deepcopy of {what}")

    fresh = ContractNet()
    fresh.load_state_dict(inner.state_dict())
    torch.testing.assert_close(forward_of(fresh, images), expected, rtol=1e-4, atol=1e-5)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    fresh_optimizer.load_state_dict(training.optimizer.state_dict())
    free_of_autogaudi(training.optimizer.state_dict(), "optimizer.state_dict()")

    twin = copy.deepcopy(inner)  # plain (checked above): the reference for the calls below
    params, twin_params = list(inner.parameters()), list(twin.parameters())
    grads = torch.autograd.grad(inner(images).sum(), params, create_graph=True)
    twin_grads = torch.autograd.grad(twin(images).sum(), twin_params, create_graph=True)
    assert [g.requires_grad for g in grads] == [g.requires_grad for g in twin_grads], "create_graph=True lost the graph"
    torch.testing.assert_close(grads, twin_grads, rtol=tolerance, atol=tolerance)

    for module in (inner, twin):
        module.zero_grad(set_to_none=True)
        torch.utils.checkpoint.checkpoint(module, images, use_reentrant=False).sum().backward()
    torch.testing.assert_close([p.grad for p in params], [p.grad for p in twin_params], rtol=tolerance, atol=tolerance)
    inner.zero_grad(set_to_none=True)

    expected = forward_of(copy.deepcopy(inner), images)  # BatchNorm's statistics moved in the training calls
    compiled = torch.compile(inner, backend="eager")  # the script's own compile (dynamo, no codegen)
    torch.testing.assert_close(forward_of(compiled, images), expected, rtol=tolerance, atol=tolerance)

    interrupt = KeyboardInterrupt("the user's")

    def interrupted(_module, _args):
        raise interrupt

    handle = inner.register_forward_pre_hook(interrupted)
    try:
        with pytest.raises(KeyboardInterrupt) as raised:
            model(images)
        assert raised.value is interrupt
    finally:
        handle.remove()

    check_dropped_objects_die()


def train_in_a_function():
    """A script's training function: its model, optimizer, DataLoader (run to its end, so that the
    loader's StopIteration passes every wrapper of ``__next__``) and tensors are its locals; weak
    references to them come back."""
    torch.manual_seed(2)
    model = ContractNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    dataset = torch.utils.data.TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 3, (16,)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=8)
    for images, labels in loader:
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {name: weakref.ref(obj) for name, obj in locals().items() if name != "dataset"}


def check_dropped_objects_die() -> None:
    """Reference counting alone frees the function's objects at its return, as without autogaudi:
    a cycle through autogaudi's objects would keep them (a DataLoader's worker processes, a model's
    device memory) until the garbage collector ran, which a script cannot see or time."""
    with collector_off():
        references = train_in_a_function()
        alive = sorted(name for name, reference in references.items() if reference() is not None)
    assert not alive, f"kept alive after the function returned: {alive}"


@pytest.fixture
def decided_trials(monkeypatch, step_clock):
    """Trials decided as the state says (``set(keep)``), each step one tick of the test's clock, and
    short: one step per block and round, one profiled pair (the states are the same, the steps fewer)."""
    for module, name in (
        (trials, "BLOCK"),
        (trials, "ROUNDS"),
        (trials, "WARMUP"),
        (step_profiler.classification, "PAIRS"),
    ):
        monkeypatch.setattr(module, name, 1)
    real_outcome = trials.Trial.outcome
    wanted = {}

    def outcome(self):
        keep, record = real_outcome(self)
        return wanted.get("keep", keep), record

    monkeypatch.setattr(trials.Trial, "outcome", outcome)
    return wanted


@pytest.fixture
def timed_updates(monkeypatch, step_clock):
    """torch's unfused Adam(W) update takes 4 ms of the step clock, its fused one 1 ms: a gain material
    to the step, which the fused optimizer keeps (where both take no time, it rightly keeps the unfused)."""
    from torch.optim import adam

    def taking(update, seconds):
        def timed(*args, **kwargs):
            step_clock.advance(seconds)
            return update(*args, **kwargs)

        return timed

    for name, seconds in (("_single_tensor_adam", 0.004), ("_multi_tensor_adam", 0.004), ("_fused_adam", 0.001)):
        monkeypatch.setattr(adam, name, taking(getattr(adam, name), seconds))


def assert_reached(info, state) -> None:
    """The unit's report row shows ``state`` (:data:`REACHED`, or where :data:`STANDS_ELSEWHERE` says)."""
    status, code = STANDS_ELSEWHERE.get((info.name, state), REACHED[state])
    code = IN_USE_CODE.get(info.name, code) if state == "in_use" else code
    row = autogaudi.report().unit(info.name)
    assert row["status"] == status and code in (None, row["reason_code"]), f"{info.name} is not {state}: {row}"
    figure = IN_USE_FIGURE.get(info.name)
    if state == "in_use" and figure is not None:
        assert row["figures"].get(figure), f"{info.name} is not {state}: {row}"


@pytest.fixture
def cheap_capture(monkeypatch):
    """Identity graphs: what capture attaches and routes, without a compiler's seconds per cell."""
    monkeypatch.setattr(CpuBackend, "graph_forward", lambda self, module, **kwargs: module._call_impl)


@pytest.fixture
def world(tmp_path):
    """A one-rank gloo group, for the units that act on DistributedDataParallel."""
    started = []

    def start():
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
        started.append(True)

    yield start
    if started:
        dist.destroy_process_group()


def test_every_unit_declares_states_the_matrix_can_reach():
    for info in UNITS:
        states = unit_class(info).spec.states
        assert states and len(set(states)) == len(states), info.name
        for state in states:
            recipe(info.name, state)


def test_the_matrix_size_is_every_unit_times_its_states():
    assert len(CELLS) == sum(len(unit_class(info).spec.states) for info in UNITS) >= 3 * len(UNITS)


@pytest.mark.parametrize(
    "info, state",
    CELLS,
    ids=[f"{info.name}-{state}" for info, state in CELLS],
)
def test_a_unit_in_this_state_breaks_nothing_a_script_does(
    info, state, request, hpu_double, decided_trials, cheap_capture, step_clock, world
):
    if on_hpu(info):
        hpu_double(lazy=True)
    if under_ddp(info):
        world()
    if info.name == "fused_optimizer":
        request.getfixturevalue("timed_updates")
    decided_trials["keep"] = state != "rejected"
    options, until = options_for(info, state)
    autogaudi.enable(**options)
    training = Training(ddp=under_ddp(info), loader_clock=step_clock if info.name == "loader_workers" else None)
    # A unit that waits for its first event (a loader built, the step profiled) is loaded then: until
    # then it has no object, and its row watches.
    unit = session().unit(info.name)
    assert unit in session().applied or (unit is None and info.waits_for), autogaudi.report().unit(info.name)
    while not (until(unit) if unit is not None else state == "watching"):
        assert training.steps < MAX_STEPS, f"{info.name} never reached {state}: {autogaudi.report().unit(info.name)}"
        training.step()
        step_clock.advance(0.001)  # computing (a loader_workers cell's batches wait besides)
        unit = session().unit(info.name)
    assert_reached(info, REACHED_FROM.get(state, state))
    if state == "failed":
        unit.failed_at_run_time(RuntimeError("injected by the contract test"))
        assert autogaudi.report().unit(info.name)["status"] == "failed"
    if state == "disabled":
        autogaudi.disable()
        assert not autogaudi.is_enabled() and autogaudi.report().as_dict()["active"] is False
    steps_done, checkpoint = training.steps, training.checkpoint()
    images = torch.randn(4, 3, 8, 8)

    tolerance = TOLERANCE.get(info.name, TOLERANCE["default"])
    check_operations(training, images, tolerance)

    autogaudi.disable()
    reference = Training()
    plain_losses = [reference.step() for _ in range(steps_done + RESUMED_STEPS)][steps_done:]
    resumed = Training()
    resumed.resume(checkpoint, steps_done)
    losses = [resumed.step() for _ in range(RESUMED_STEPS)]
    torch.testing.assert_close(losses, plain_losses, rtol=tolerance, atol=tolerance)
