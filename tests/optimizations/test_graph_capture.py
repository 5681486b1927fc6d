"""graph_capture: not on a device-bound run; forced on the HPU double it caches the module inside
DDP through ModuleCacher with the same numerics; a recompile storm switches it off; a forward that
branches on a tensor is never captured there, even forced (the double's replay runs the recorded
ops, so it would take the recorded branch); on the CPU a host-bound run gets a torch.compile trial
whose steps train like plain ones."""

import gc
import inspect
import itertools
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autogaudi
from autogaudi.backends.cpu import CpuBackend
from autogaudi.measure import numerics
from autogaudi.optimizations import step_profiler
from autogaudi.optimizations.graph_capture import captured_call, host_reads
from autogaudi.optimizations.graph_capture import unit as graph_capture_unit
from autogaudi.optimizations.graph_capture.unit import GraphCapture
from tests.optimizations.test_step_profiler import STEPS, Timed, endless, train


def row():
    return autogaudi.report().unit("graph_capture")


class Bookkeeping(nn.Module):
    """A tiny layer with the Python work model code often does around its ops (shape checks,
    config lookups): the host's time, not the kernels'. A little of it: dynamo traces every
    iteration of the loop when it compiles the layer."""

    def __init__(self, work: int = 30):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.work = work

    def forward(self, inputs):
        sum(index * index for index in range(self.work))
        return torch.tanh(self.linear(inputs))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))


def batches(sizes=None):
    generator = torch.Generator().manual_seed(1)
    for index in range(10_000):
        size = sizes[index % len(sizes)] if sizes else 8
        yield torch.randn(size, 16, generator=generator), torch.randint(0, 3, (size,), generator=generator)


def losses_of(model, data, steps=STEPS + 6):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _, (inputs, labels) in zip(range(steps), data):
        loss = nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_device_bound_run_is_not_captured():
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture")
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 3))
    train(model, endless(lambda: (torch.randn(512, 1024), torch.randint(0, 3, (512,)))))
    assert row()["reason_code"] == "not_host_bound" and row()["reason_params"]["bound"] == "device"
    assert "forward" not in vars(model)


@pytest.mark.slow
def test_a_trial_asked_for_runs_at_once_on_a_device_bound_run():
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture", trial="graph_capture")
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 3))
    train(model, endless(lambda: (torch.randn(256, 256), torch.randint(0, 3, (256,)))), steps=STEPS + 40)
    profile = autogaudi.report().unit("step_profiler")["figures"]
    (trial,) = autogaudi.report().trials
    assert trial["candidate"] == "graph_capture" and trial["started_at_step"] == profile["profiled_at_step"]


def test_forced_on_the_double_caches_the_module_inside_ddp(hpu_double, tmp_path):
    calls = hpu_double(lazy=True)
    plain = losses_of(mlp(), batches())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
        inner = mlp()
        losses = losses_of(nn.parallel.DistributedDataParallel(inner), batches())
        torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)
        assert (row()["reason_code"], row()["reason_params"]) == ("captured_forced", {"model": "Sequential"})
        names = calls.names()
        first = names.index("module_cacher")
        assert calls.CALLS[first][1] == {"module": "Sequential", "max_graphs": 10}
        # one graph for the one input shape, replayed on every later step
        assert names[first + 1 :].count("module_cacher_capture") == 1
        replays = [details for name, details in calls.CALLS[first:] if name == "module_cacher_replay"]
        assert len(replays) >= 5
        # zero_grad(set_to_none=False) while graphs are on: every replay sees the same gradient tensors
        assert all(details["gradients_reused"] for details in replays[1:])
        assert "forward" not in vars(inner)  # calls are routed through nn.Module's compiled-call slot
        assert "_compiled_call_impl" in vars(inner)
        autogaudi.disable()
        assert "_compiled_call_impl" not in vars(inner) and "forward" not in vars(inner)  # as it was
    finally:
        autogaudi.disable()
        dist.destroy_process_group()


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, inputs):
        return torch.utils.checkpoint.checkpoint(self.body, inputs, use_reentrant=False)


class FlaggedCheckpointing(nn.Module):  # how Hugging Face models say they checkpoint
    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.body.gradient_checkpointing = True

    def forward(self, inputs):
        return self.body(inputs)


class PartlyUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.unused_head = nn.Linear(3, 3)

    def forward(self, inputs):
        return self.body(inputs)


class VarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, *inputs):
        return self.body(inputs[0])


class Hooked(nn.Module):
    """An activation logger on a submodule: Python that an HPU graph replay does not run."""

    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.seen = []
        self.body[0].register_forward_hook(self.log)

    def log(self, module, inputs, output):
        self.seen.append(tuple(output.shape))

    def forward(self, inputs):
        return self.body(inputs)


@pytest.mark.parametrize(
    "model, refusal",
    [
        (Checkpointed, ("gradient_checkpointing", {})),
        (FlaggedCheckpointing, ("gradient_checkpointing", {})),
        (PartlyUnused, ("parameters_without_gradient", {"without": 2, "total": 6})),
        (VarArgs, ("positional_forward", {"model": "VarArgs"})),
        (Hooked, ("module_hooks", {"where": "Linear"})),
    ],
)
def test_hpu_graphs_are_refused_where_they_would_crash_or_change_training(hpu_double, model, refusal):
    calls = hpu_double(lazy=True)
    plain = losses_of(model(), batches())
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    losses = losses_of(model(), batches())
    assert (row()["reason_code"], row()["reason_params"]) == refusal, row()
    assert "module_cacher" not in calls.names()
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)


def test_the_double_breaks_where_module_cacher_would(hpu_double):
    """What the refusals above guard against, as the double (after the bridge's hpu/graphs.py) does it."""
    hpu_double(lazy=True)
    from habana_frameworks.torch.hpu import ModuleCacher

    with pytest.raises(AssertionError, match="Unsupported argument type"):
        ModuleCacher()(model=VarArgs())
    unused = ModuleCacher()(model=PartlyUnused())
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        unused(torch.randn(4, 16))
    hooked = ModuleCacher()(model=Hooked())
    for _ in range(3):  # a capture, then two replays: the hook ran once
        hooked(torch.randn(4, 16))
    assert hooked.seen == [(4, 32)]
    model = ModuleCacher()(model=mlp())
    first = model(torch.randn(4, 16))
    second = model(torch.randn(4, 16))  # same graph: replayed into the tensors the first call returned
    torch.testing.assert_close(first, second)
    assert {"orig_forward", "forward", "capture_start", "capture_end"} <= set(vars(model))


class Branching(nn.Module):
    """A Python decision on a tensor's value inside forward: loud hidden states are squashed. Both
    sides use every parameter, so nothing but the branch keeps it from HPU graphs."""

    THRESHOLD = 1.0

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.encode = nn.Linear(16, 32)
        self.head = nn.Linear(32, 3)
        self.forwards = []  # shared with the cacher's shallow copy: how often the Python forward ran

    def forward(self, inputs):
        self.forwards.append(len(inputs))
        hidden = torch.relu(self.encode(inputs))
        if hidden.mean() > self.THRESHOLD:  # the branch
            hidden = torch.tanh(hidden)
        return self.head(hidden)


BRANCH_LINE = next(n for n, text in enumerate(inspect.getsource(Branching).splitlines()) if "# the branch" in text)
SWITCH_AT = STEPS + 2  # after the profile, so after a forced capture


def quiet_then_loud(switch_at=SWITCH_AT):
    """Batches that take the quiet side of Branching's branch up to ``switch_at``, the loud side after."""
    for index, (inputs, labels) in enumerate(batches()):
        yield inputs * (0.1 if index < switch_at else 10.0), labels


def test_the_double_replays_the_recorded_ops_not_the_python_forward(hpu_double):
    """As a Gaudi's graph: a replay runs the ops recorded at capture on the new inputs and parameters,
    with their backward, and the branch taken at capture is taken again, whatever the new batch says."""
    calls = hpu_double(lazy=True)
    from habana_frameworks.torch.hpu import ModuleCacher

    eager = Branching()
    model = ModuleCacher()(model=Branching(), inplace=True)
    quiet, again, _, loud = [inputs for inputs, _ in itertools.islice(quiet_then_loud(switch_at=3), 4)]
    for inputs in (quiet, again):
        output = model(inputs).clone()
        expected = eager(inputs)
        torch.testing.assert_close(output, expected)
        output.sum().backward()
        expected.sum().backward()
        torch.testing.assert_close([p.grad for p in model.parameters()], [p.grad for p in eager.parameters()])
    assert model.forwards == [8]  # the capture ran Python, the replay did not
    assert calls.names() == ["module_cacher", "module_cacher_capture", "module_cacher_replay"]
    replayed = model(loud)
    assert eager.encode(loud).relu().mean() > Branching.THRESHOLD  # eager would squash it
    torch.testing.assert_close(replayed, eager.head(eager.encode(loud).relu()))  # the recorded side
    assert not torch.allclose(replayed, eager(loud))
    assert calls.names()[-1] == "module_cacher_replay" and model.forwards == [8]


def test_a_forward_that_branches_on_a_tensor_is_never_captured_even_forced(hpu_double):
    calls = hpu_double(lazy=True)
    plain = losses_of(Branching(), quiet_then_loud())
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    losses = losses_of(Branching(), quiet_then_loud())
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)
    where = f"{os.path.relpath(inspect.getsourcefile(Branching))}:{inspect.getsourcelines(Branching)[1] + BRANCH_LINE}"
    assert (row()["reason_code"], row()["reason_params"]) == (
        "data_dependent_control_flow",
        {"module": "Branching", "where": where, "backend": "hpu"},
    ), row()
    assert "module_cacher" not in calls.names()


class BranchingInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Branching()

    def forward(self, inputs):
        return self.block(inputs)


def test_a_read_is_found_in_the_forward_of_the_sub_module_that_makes_it():
    line = inspect.getsourcelines(Branching)[1] + BRANCH_LINE
    path = os.path.abspath(inspect.getsourcefile(Branching))
    model = BranchingInside()
    assert host_reads.forward_reading(model, [(path, line)]) == (model.block, (path, line))
    assert host_reads.forward_reading(model, [(path, inspect.getsourcelines(losses_of)[1] + 3)]) is None


def test_hpu_capture_leaves_no_cacher_attribute_and_the_model_saves_as_a_plain_one(hpu_double):
    hpu_double(lazy=True)
    from habana_frameworks.torch.hpu import graphs

    from tests.optimizations.test_capture_safety import assert_plain_copies

    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    model = mlp()
    keys = set(vars(model))
    losses_of(model, batches())
    assert (row()["reason_code"], row()["reason_params"]) == ("captured_forced", {"model": "Sequential"})
    assert set(vars(model)) == keys | {"_compiled_call_impl"}  # no orig_forward, capture_start, ...
    assert_plain_copies(model, torch.randn(4, 16))
    autogaudi.disable()
    gc.collect()
    assert set(vars(model)) == keys and not list(graphs.LIVE_CACHERS)  # the cacher and its graphs let go


def test_a_rejected_hpu_capture_lets_go_of_the_cacher_and_its_graphs(
    hpu_double, monkeypatch, step_clock, capture_one_off
):
    hpu_double(lazy=True)
    from habana_frameworks.torch.hpu import graphs

    from autogaudi.backends.hpu import HpuBackend
    from autogaudi.measure import trials
    from autogaudi.optimizations import step_profiler

    monkeypatch.setattr(
        step_profiler.classification, "classify", lambda *a, **k: ("host", "read as host-bound by the test")
    )
    capture_one_off(HpuBackend, 0.0)
    monkeypatch.setattr(trials, "MARGIN", 0.0)
    step_clock.tick = 1e-6  # the profile's steps take some time too: it reads the one clock
    replay = graphs.ModuleCacher._replay
    monkeypatch.setattr(graphs.ModuleCacher, "_replay", lambda *a: step_clock.advance(0.004) or replay(*a))
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", trial="graph_capture")
    model = mlp()
    keys = set(vars(model))
    losses_of(model, batches(), steps=STEPS + 40)
    assert [(t["candidate"], t["decision"]) for t in autogaudi.report().trials] == [("graph_capture", "rejected")]
    assert row()["numerics"] == ["rounding", "random"]  # rejected, but its trial's steps ran captured
    gc.collect()
    assert set(vars(model)) == keys and not list(graphs.LIVE_CACHERS)


def compiled_wrapper():
    return torch.compile(mlp(), backend="eager")  # the "eager" backend: dynamo's tracing, no codegen


def compiled_in_place():
    model = mlp()
    model.compile(backend="eager")
    return model


@pytest.mark.parametrize("model", [compiled_wrapper, compiled_in_place])
def test_a_model_the_script_compiles_itself_is_left_alone(hpu_double, model):
    calls = hpu_double(lazy=True)
    plain = losses_of(model(), batches())
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    losses = losses_of(model(), batches())
    assert row()["reason_code"] == "compiled_by_script"
    assert "module_cacher" not in calls.names()
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)


def test_zero_grad_is_left_alone_where_graphs_do_not_hold_gradients():
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture", force="graph_capture")
    model = mlp()
    losses_of(model, batches())
    assert "zero_grad" not in vars(model)
    assert model[0].weight.grad is None  # the user's zero_grad() set it to None, as without autogaudi


def test_a_recompile_storm_switches_capture_off_and_names_the_shapes(hpu_double):
    calls = hpu_double(lazy=True)
    sizes = list(range(2, 14))  # a new batch size on every step: a new graph each time
    plain = losses_of(mlp(), batches(sizes), steps=STEPS + 12)
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    losses = losses_of(mlp(), batches(sizes), steps=STEPS + 12)
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)
    assert row()["reason_code"] == "dynamic_shapes" and row()["reason_params"]["count"] == 9, row()
    captured = [details["shapes"] for name, details in calls.CALLS if name == "module_cacher_capture"]
    assert len(captured) == 8  # capped: nothing is captured after the switch-off


@pytest.mark.slow
def test_host_bound_plain_loop_asked_for_gets_a_compile_trial_and_trains_like_plain(monkeypatch, capture_one_off):
    def tiny():  # the profile is given below: little Python per layer, so that dynamo traces it quickly
        torch.manual_seed(0)
        return nn.Sequential(*[Bookkeeping() for _ in range(20)], nn.Linear(8, 3))

    def data():
        generator = torch.Generator().manual_seed(1)
        while True:
            yield torch.randn(4, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator)

    capture_one_off(CpuBackend, 0.15)
    # The profile as given: measuring is the profiler's tests' business (a busy machine reads a
    # Python-heavy step's ops as slow kernels); here, what the unit does with a host-bound profile.
    monkeypatch.setattr(
        step_profiler.classification, "classify", lambda *a, **k: ("host", "read as host-bound by the test")
    )
    steps = STEPS + 60
    plain = losses_of(tiny(), data(), steps=steps)
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture", trial="graph_capture")
    losses = losses_of(tiny(), data(), steps=steps)
    report = autogaudi.report()
    assert report.unit("step_profiler")["figures"]["bound"] == "host"
    (trial,) = report.trials
    # the real compile may run past the given estimate's high end: then the trial stops in its warm-up
    assert trial["candidate"] == "graph_capture" and trial["decision"] in ("kept", "rejected", "stopped")
    assert trial["set_up_s"] > 0 and trial["one_off_s"] > trial["set_up_s"]  # compiler import, then compiling
    torch.testing.assert_close(losses, plain, rtol=1e-4, atol=1e-5)  # same math, float reassociation only


def test_under_the_defaults_a_host_bound_loop_is_not_tried_and_nothing_is_set_up(step_clock):
    """A trial would run the user's steps captured, from a step the profile's timings set: a seeded
    run's numbers would move with the load. So none is run unless asked for, and nothing is set up
    (no compiler imported, nothing on the model). The profile is host-bound on given times: 2 ms
    steps of Python."""
    torch.manual_seed(0)
    model = Timed(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)), host=0.002)
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture")
    losses_of(model, endless(lambda: (torch.randn(4, 8), torch.randint(0, 3, (4,)))), steps=STEPS + 5)
    assert autogaudi.report().unit("step_profiler")["figures"]["bound"] == "host"
    assert row()["reason_code"] == "changes_numbers" and row()["status"] == "not needed", row()
    assert "_compiled_call_impl" not in vars(model) and autogaudi.report().trials == []


class WithDropout(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 3))

    def forward(self, inputs):
        return self.body(inputs)


@pytest.mark.slow
@pytest.mark.parametrize("tier, model_class", [("whole", WithDropout), ("regional", lambda: Tower(dropout=0.5))])
@pytest.mark.parametrize("exact", [True, False])
def test_exact_random_compiles_dropout_to_eager_masks(exact, tier, model_class, monkeypatch):
    from autogaudi.measure import one_offs

    monkeypatch.setattr(one_offs, "REGIONAL_KEEPS", 1.0 if tier == "regional" else 1e-9)

    def run():
        torch.manual_seed(2)  # the dropout stream
        return losses_of(model_class(), batches(), steps=STEPS + 10)

    plain = run()
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture", force="graph_capture", exact_random=exact)
    losses = run()
    assert row()["figures"]["capture_tier"] == tier
    notes = row()["note_codes"]
    if exact:
        assert "dropout_exact" in notes and "dropout_differs" not in notes
        torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)
    else:  # what the option is for: compiled dropout trains on other masks
        assert "dropout_differs" in notes and "dropout_exact" not in notes
        assert max(abs(a - b) for a, b in zip(losses, plain)) > 1e-3


def test_hpu_graphs_and_eager_steps_never_share_a_gradient_tensor(hpu_double):
    """HPU lazy graphs write gradients into static tensors: while they are on, zero_grad keeps the
    tensors; once they are off, every gradient is a copy of its own, so an eager step (or a later
    set_to_none) never writes into, or frees, a tensor a graph still owns."""
    hpu_double(lazy=True)
    plain = losses_of(mlp(), batches())
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    model = mlp()
    losses = losses_of(model, batches())  # zero_grad() with torch's default set_to_none=True
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)
    held = [p.grad for p in model.parameters()]
    assert all(grad is not None for grad in held)  # kept as tensors while the graphs were on
    autogaudi.disable()
    mine = [p.grad for p in model.parameters()]
    assert all(a is not b and a.data_ptr() != b.data_ptr() for a, b in zip(mine, held))
    torch.testing.assert_close(mine, held)


class Tower(nn.Module):
    """An embedding, four repeats of one block and a head: a GPT's shape in miniature (with
    ``dropout``, each block ends in a dropout of that rate)."""

    def __init__(self, dropout=None):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(16, 16)
        ending = [] if dropout is None else [nn.Dropout(dropout)]
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh(), *ending) for _ in range(4))
        self.head = nn.Linear(16, 3)

    def forward(self, inputs):
        hidden = self.embed(inputs)
        for block in self.blocks:
            hidden = hidden + block(hidden)
        return self.head(hidden)


def test_regional_capture_compiles_the_block_class_once_and_is_undone_exactly(monkeypatch):
    from autogaudi.measure import one_offs

    monkeypatch.setattr(one_offs, "REGIONAL_KEEPS", 1.0)  # regional pays back sooner whatever its estimate
    plain = losses_of(Tower(), batches())
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture", force="graph_capture")
    model = Tower()
    keys = [set(vars(module)) for module in model.modules()]
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from autogaudi.backends.base import compile_workers_running

    graphs_before = counters["stats"]["unique_graphs"]
    pool_before, settings = compile_workers_running(), dict(cpp_wrapper=False, compile_threads=None)
    with inductor_config.patch(settings):  # the script's own settings, whatever other tests left
        losses = losses_of(model, batches())
        # The CPU builds a block's graph as one C++ file, in this process: no compile pool started,
        # and the options were the compile's own, not the script's.
        assert compile_workers_running() == pool_before
        assert {key: getattr(inductor_config, key) for key in settings} == settings
    figures = row()["figures"]
    assert figures["regions"] == {"container": "blocks", "block": "Sequential", "count": 4}
    assert figures["one_off_predicted_s"] == figures["one_off_predicted_regional_s"]
    assert figures["one_off_predicted_regional_s"] < figures["one_off_predicted_whole_s"]
    assert counters["stats"]["unique_graphs"] - graphs_before == 1  # one graph for the four blocks
    torch.testing.assert_close(losses, plain, rtol=1e-4, atol=1e-5)
    autogaudi.disable()
    assert [set(vars(module)) for module in model.modules()] == keys


def test_the_replay_tier_captures_through_the_backends_graph_replay_and_is_undone_exactly(monkeypatch):
    """A backend offering the replay tier (CUDA's, played here by Dynamo's eager backend on the CPU):
    where its estimate pays back soonest, the model is captured through ``graph_replay``."""
    from autogaudi.backends import base

    replayed = []

    def graph_replay(backend, module):
        replayed.append(module)
        return base.compile_calls(module, backend="eager")

    monkeypatch.setattr(CpuBackend, "replay_one_off_rate_s", 1e-12)
    monkeypatch.setattr(CpuBackend, "least_replay_one_off_s", 1e-3)
    monkeypatch.setattr(CpuBackend, "graph_replay", graph_replay)
    plain = losses_of(mlp(), batches())
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture", force="graph_capture")
    model = mlp()
    keys = [set(vars(module)) for module in model.modules()]
    losses = losses_of(model, batches())
    figures = row()["figures"]
    assert replayed == [model] and figures["capture_tier"] == "replay"
    assert figures["one_off_predicted_s"] == figures["one_off_predicted_replay_s"]
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)
    autogaudi.disable()
    assert [set(vars(module)) for module in model.modules()] == keys


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on a lent GPU)")
def test_the_replay_tier_on_a_real_gpu_gives_the_eager_losses(monkeypatch):
    """CUDA graphs of torch's own kernels: the same kernels replayed, so the losses match eager's."""
    from autogaudi.measure import one_offs

    monkeypatch.setattr(one_offs, "REPLAY_KEEPS", 1.0)  # replay pays back soonest whatever the estimates

    def cuda_batches():
        for inputs, labels in batches():
            yield inputs.cuda(), labels.cuda()

    plain = losses_of(mlp().cuda(), cuda_batches())
    autogaudi.enable(device="cuda", only="step_profiler,graph_capture", force="graph_capture")
    losses = losses_of(mlp().cuda(), cuda_batches())
    report = row()
    assert report["figures"]["capture_tier"] == "replay" and report["status"] == "applied"
    torch.testing.assert_close(losses, plain, rtol=1e-4, atol=1e-5)


def _seeded_run(model_class):
    """Losses, final parameters, and the random streams after a seeded run."""
    import random

    import numpy

    torch.manual_seed(2)
    random.seed(2)
    numpy.random.seed(2)
    model = model_class()
    losses = losses_of(model, batches())
    streams = torch.get_rng_state(), random.getstate(), numpy.random.get_state()[1].tobytes()
    return losses, [p.detach().clone() for p in model.parameters()], streams


def _same_run(first, second):
    assert first[0] == second[0]
    assert all(torch.equal(a, b) for a, b in zip(first[1], second[1]))
    assert torch.equal(first[2][0], second[2][0]) and first[2][1:] == second[2][1:]


@pytest.mark.parametrize("model_class", [mlp, WithDropout])
def test_the_first_captured_call_is_measured_against_an_eager_copy_and_the_run_is_unchanged(
    hpu_double, monkeypatch, model_class
):
    hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    measured = _seeded_run(model_class)
    figure = row()["figures"]["numerics_measured"]
    dropout = model_class is WithDropout
    assert figure["steps"] == 1
    assert figure["of"] == ("outputs, dropout masks drawn otherwise" if dropout else "outputs")
    assert ("dropout_differs" in row()["note_codes"]) == dropout
    autogaudi.disable()
    monkeypatch.setattr(GraphCapture, "_measure_numerics", lambda *args: None)
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    unmeasured = _seeded_run(model_class)
    assert "numerics_measured" not in row()["figures"]
    _same_run(measured, unmeasured)  # losses, parameters, torch's and Python's random streams


def test_a_copy_that_would_not_fit_leaves_capture_not_measured(hpu_double, monkeypatch):
    hpu_double(lazy=True)
    monkeypatch.setattr(numerics, "copy_fits", lambda tensors, backend: False)
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    losses_of(mlp(), batches())
    assert row()["reason_code"] == "captured_forced"
    assert "numerics_measured" not in row()["figures"]
    assert "numerics_not_measured_memory" in row()["note_codes"]


class _Clock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class _BackwardCompiles(torch.autograd.Function):
    """Identity whose backward, the first time it runs under capture, takes the clock ``seconds``
    on: the compiler building the backward graph lazily, at the step's first backward."""

    clock = seconds = None

    @staticmethod
    def forward(ctx, inputs):
        return inputs.view_as(inputs)

    @staticmethod
    def backward(ctx, grad):
        if _BackwardCompiles.seconds:
            _BackwardCompiles.clock.now += _BackwardCompiles.seconds
            _BackwardCompiles.seconds = None
        return grad


class LazyBackward(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = mlp()

    def forward(self, inputs):
        return _BackwardCompiles.apply(self.net(inputs))


def test_the_one_off_runs_to_the_end_of_the_step_the_first_compile_started_in(monkeypatch):
    """The forward compiles in the captured call (2 s on the test's clock) and the backward at the
    step's first backward (5 s): the one-off counts both, less an eager step, and learns from both."""
    from autogaudi.backends import base

    clock = _Clock()
    monkeypatch.setattr(graph_capture_unit, "time", clock)
    monkeypatch.setattr(captured_call, "time", clock)

    def graph_forward(backend, module, **_options):
        compiled = base.compile_calls(module, backend="eager")

        def first_call_compiles(*args, **kwargs):
            if _BackwardCompiles.seconds is None and not clock.now:
                clock.now += 2.0
                _BackwardCompiles.clock, _BackwardCompiles.seconds = clock, 5.0
            return compiled(*args, **kwargs)

        return first_call_compiles

    monkeypatch.setattr(CpuBackend, "graph_forward", graph_forward)
    learned = []
    monkeypatch.setattr(captured_call.one_offs, "remember", lambda cache, backend, record: learned.append(record))
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture", force="graph_capture")
    losses_of(LazyBackward(), batches())
    figures = row()["figures"]
    eager_s = autogaudi.report().unit("step_profiler")["figures"]["ms_per_step"] / 1000
    assert figures["warm_up_s"] == pytest.approx(7.0 - eager_s, abs=1e-3)
    assert figures["one_off_actual_s"] == pytest.approx(figures["set_up_s"] + figures["warm_up_s"], abs=2e-3)
    assert [record["actual_s"] for record in learned] == [pytest.approx(figures["one_off_actual_s"], abs=2e-3)]


def test_the_compile_is_saved_for_the_next_run_once_its_backward_is_built_too(monkeypatch):
    """AOTAutograd builds the backward at the first backward: saved at the call, the next run's
    artifacts would hold the forward alone."""
    from autogaudi.backends import base
    from autogaudi.entry import runtime

    backwards_at = {}

    def graph_forward(backend, module, **_options):
        compiled = base.compile_calls(module, backend="eager")

        def call(*args, **kwargs):
            backwards_at.setdefault("compiled", runtime._STATE.session.steps.backwards)
            return compiled(*args, **kwargs)

        return call

    def save_artifacts(cache, key, backend):
        backwards_at.setdefault("saved", runtime._STATE.session.steps.backwards)
        return True

    monkeypatch.setattr(CpuBackend, "graph_forward", graph_forward)
    monkeypatch.setattr(captured_call.one_offs, "save_artifacts", save_artifacts)
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture", force="graph_capture")
    losses_of(mlp(), batches())
    assert backwards_at["saved"] == backwards_at["compiled"] + 1


def test_a_later_input_shapes_compile_runs_to_the_end_of_its_step_too(monkeypatch):
    """Each new shape compiles its own backward lazily: 1 s in the call, 3 s at the backward."""
    from autogaudi.backends import base

    clock = _Clock()
    monkeypatch.setattr(graph_capture_unit, "time", clock)
    monkeypatch.setattr(captured_call, "time", clock)

    def graph_forward(backend, module, **_options):
        compiled, seen = base.compile_calls(module, backend="eager"), set()

        def each_shape_compiles(inputs):
            if inputs.shape not in seen:
                seen.add(inputs.shape)
                clock.now += 1.0
                _BackwardCompiles.clock, _BackwardCompiles.seconds = clock, 3.0
            return compiled(inputs)

        return each_shape_compiles

    monkeypatch.setattr(CpuBackend, "graph_forward", graph_forward)
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture", force="graph_capture")
    model = LazyBackward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sizes = [8] * (STEPS + 6) + [5, 5]
    for step, (inputs, labels) in zip(range(len(sizes)), batches(sizes)):
        if step == STEPS + 6:
            assert "later_compiles_s" not in row()["figures"]
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    eager_s = autogaudi.report().unit("step_profiler")["figures"]["ms_per_step"] / 1000
    assert row()["figures"]["later_compiles_s"] == pytest.approx(4.0 - eager_s, abs=1e-3)
