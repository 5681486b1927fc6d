"""step_profiler: the classification rule, CPU fixtures that are host-, device- and input-bound,
the HPU path through the double's timing hook, and which module it names as the training model."""
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import autogaudi
from autogaudi import runtime
from autogaudi.optimizations.step_profiler import WINDOW, classify
from tests.helpers import SCRIPTS
from tests.optimizations.ddp_helpers import TORCHRUN, torchrun

STEPS = 3 + WINDOW + 3  # warm-up, the timed window, the census step, and a couple more


def test_classification_rule():
    assert classify(1.0, input_wait_s=0.6, device_busy_s=0.3)[0] == "input"
    assert classify(1.0, input_wait_s=0.1, device_busy_s=0.3)[0] == "host"
    assert classify(1.0, input_wait_s=0.1, device_busy_s=0.8)[0] == "device"


class Slow(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        time.sleep(0.003)
        return torch.ones(4), 0


def train(model, batches, steps=STEPS):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _, (inputs, labels) in zip(range(steps), batches):
        nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad()


def endless(make):
    while True:
        yield make()


def profile_row():
    return autogaudi.report().unit("step_profiler")


class Bookkeeping(nn.Module):
    """A tiny layer with the Python work model code often does around its ops (shape checks,
    config lookups): the host's time, not the kernels'."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, inputs):
        sum(index * index for index in range(3000))
        return torch.tanh(self.linear(inputs))


def test_python_heavy_tiny_layers_are_host_bound():
    autogaudi.enable(device="cpu", only="step_profiler")
    model = nn.Sequential(*[Bookkeeping() for _ in range(30)], nn.Linear(8, 3))
    train(model, endless(lambda: (torch.randn(4, 8), torch.randint(0, 3, (4,)))))
    figures = profile_row()["figures"]
    assert figures["bound"] == "host", profile_row()
    assert figures["ops_per_step"] > 300 and figures["compute_fraction"] < 0.5


def test_large_matrix_products_are_device_bound():
    autogaudi.enable(device="cpu", only="step_profiler")
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 3))
    train(model, endless(lambda: (torch.randn(512, 1024), torch.randint(0, 3, (512,)))))
    figures = profile_row()["figures"]
    assert figures["bound"] == "device", profile_row()
    assert figures["compute_fraction"] >= 0.5 and figures["model"] == "Sequential"


def test_a_slow_dataset_is_input_bound():
    autogaudi.enable(device="cpu", only="step_profiler")
    train(nn.Linear(4, 2), iter(DataLoader(Slow(), batch_size=4)))
    figures = profile_row()["figures"]
    assert figures["bound"] == "input" and figures["input_wait_fraction"] > 0.5, profile_row()


@pytest.mark.parametrize("device_seconds,bound", [(0.05, "device"), (0.0, "host")])
def test_hpu_device_time_comes_from_the_synchronize_wait(hpu_double, device_seconds, bound):
    calls = hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="step_profiler")
    calls.DEVICE_SECONDS[0] = device_seconds
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    train(model, endless(lambda: (torch.randn(8, 16), torch.randint(0, 3, (8,)))))
    assert profile_row()["figures"]["bound"] == bound, profile_row()
    # the census step ends with a flush and one wait; no other step waits for the device
    assert calls.names() == ["synchronize", "mark_step", "synchronize"]


def test_the_training_model_is_the_module_inside_ddp(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        autogaudi.enable(device="cpu", only="step_profiler")
        inner = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
        model = nn.parallel.DistributedDataParallel(inner)
        train(model, endless(lambda: (torch.randn(4, 8), torch.randint(0, 3, (4,)))))
        profiler = runtime._STATE.session.unit("step_profiler")
        assert profiler.profile.model is inner
    finally:
        autogaudi.disable()
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_that_measure_apart_follow_rank_zero_and_finish_the_trial_together(tmp_path):
    """Rank 1 waits for slow data (input-bound), rank 0 does not (host-bound): were each to act on
    its own profile, rank 0 would run a compile trial whose decision it broadcasts while rank 1 sits
    in DDP's all-reduce, and the job would hang (run_python's timeout fails the test then)."""
    env = {"AUTOGAUDI": "1", "AUTOGAUDI_QUIET": "1", "STEPS": "40", "SLOW_DATA_RANK": "1"}
    result, workers = torchrun(tmp_path, *TORCHRUN, SCRIPTS / "ddp_train.py", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    profiles = [worker["units"]["step_profiler"] for worker in workers]
    assert profiles[0]["figures"]["bound"] == profiles[1]["figures"]["bound"] == "host"
    assert any("this rank measured input-bound" in note for note in profiles[1]["notes"]), profiles[1]
    captures = [worker["units"]["graph_capture"]["reason"] for worker in workers]
    assert captures[0] == captures[1] and "trial running" not in captures[0]  # the trial ended, decided alike
    assert workers[0]["checksum"] == workers[1]["checksum"]
