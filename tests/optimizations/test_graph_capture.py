"""graph_capture: not on a device-bound run; forced on the HPU double it caches the module inside
DDP through ModuleCacher with the same numerics; a recompile storm switches it off; on the CPU a
host-bound run gets a torch.compile trial whose steps train like plain ones."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import autogaudi
from tests.optimizations.test_step_profiler import STEPS, Bookkeeping, endless, train


def row():
    return autogaudi.report().unit("graph_capture")


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
    assert row()["reason"].startswith("not captured: the run is device-bound")
    assert "forward" not in vars(model)


def test_forced_on_the_double_caches_the_module_inside_ddp(hpu_double, tmp_path):
    calls = hpu_double(lazy=True)
    plain = losses_of(mlp(), batches())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
        inner = mlp()
        losses = losses_of(nn.parallel.DistributedDataParallel(inner), batches())
        torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)
        assert row()["reason"] == "captured Sequential (forced)"
        names = calls.names()
        first = names.index("module_cacher")
        assert calls.CALLS[first][1] == {"module": "Sequential", "max_graphs": 10}
        # one graph for the one input shape, replayed on every later step
        assert names[first + 1:].count("module_cacher_capture") == 1
        assert names[first + 1:].count("module_cacher_replay") >= 5
        assert "forward" in vars(inner)
        autogaudi.disable()
        assert "forward" not in vars(inner)  # the module is as it was
    finally:
        autogaudi.disable()
        dist.destroy_process_group()


def test_a_recompile_storm_switches_capture_off_and_names_the_shapes(hpu_double):
    calls = hpu_double(lazy=True)
    sizes = list(range(2, 14))  # a new batch size on every step: a new graph each time
    plain = losses_of(mlp(), batches(sizes), steps=STEPS + 12)
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    losses = losses_of(mlp(), batches(sizes), steps=STEPS + 12)
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)
    reason = row()["reason"]
    assert reason.startswith("switched off: dynamic shapes, 9 distinct input shapes"), reason
    captured = [details["shapes"] for name, details in calls.CALLS if name == "module_cacher_capture"]
    assert len(captured) == 8  # capped: nothing is captured after the switch-off


@pytest.mark.slow
def test_host_bound_cpu_run_gets_a_compile_trial_that_trains_like_plain():
    def tiny():  # Python-heavy tiny layers: a 20-layer plain MLP sat on the 50% line and flipped
        torch.manual_seed(0)
        return nn.Sequential(*[Bookkeeping() for _ in range(20)], nn.Linear(8, 3))

    def data():
        generator = torch.Generator().manual_seed(1)
        while True:
            yield torch.randn(4, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator)

    steps = STEPS + 30
    plain = losses_of(tiny(), data(), steps=steps)
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture")
    losses = losses_of(tiny(), data(), steps=steps)
    report = autogaudi.report()
    assert report.unit("step_profiler")["figures"]["bound"] == "host"
    (trial,) = report.trials
    assert trial["candidate"] == "graph_capture" and trial["decision"] in ("kept", "reverted")
    assert trial["one_off_s"] > 0  # compilation, measured apart from the steady steps
    torch.testing.assert_close(losses, plain, rtol=1e-4, atol=1e-5)  # same math, float reassociation only
