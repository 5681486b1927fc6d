"""engines: which distributed engine owns a model (FSDP2 at its root or on its blocks only, DDP,
none), decided without importing torch.distributed's packages for a script that never did."""

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from autogaudi.watch.engines import ddp_wrapped, fsdp2_managed
from tests.helpers import run_python


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def blocks():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))


def test_fsdp2_at_the_root_or_on_blocks_only_owns_the_model(one_rank):
    assert not fsdp2_managed(blocks())
    sharded = fully_shard(blocks())
    assert fsdp2_managed(sharded) and not ddp_wrapped(sharded)
    inner = blocks()
    fully_shard(inner[0])  # the root stays a plain Sequential; its first block's parameters are DTensors
    assert fsdp2_managed(inner)
    assert not fsdp2_managed(inner[1])


def test_ddp_wraps_without_fsdp2(one_rank):
    model = nn.parallel.DistributedDataParallel(blocks())
    assert ddp_wrapped(model) and not fsdp2_managed(model)
    assert not ddp_wrapped(model.module)


def test_asking_imports_neither_fsdp_nor_dtensor():
    code = (
        "import sys, torch\n"
        "from autogaudi.watch.engines import ddp_wrapped, fsdp2_managed\n"
        "model = torch.nn.Linear(2, 2)\n"
        "assert not fsdp2_managed(model) and not ddp_wrapped(model)\n"
        "print(sorted(name for name in ('torch.distributed.fsdp', 'torch.distributed.tensor') if name in sys.modules))"
    )
    result = run_python("-c", code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_units_that_change_a_models_call_step_aside_for_fsdp2_and_training_stays_plain(one_rank):
    """Capture, channels_last and mixed precision each leave an FSDP2-sharded model alone, with a
    code saying what to do instead, even when forced; the run's losses are plain FSDP2's."""
    import torch

    import autogaudi
    from autogaudi.watch.model_call import route_of
    from tests.optimizations.test_step_profiler import STEPS

    def run():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        generator, losses = torch.Generator().manual_seed(1), []
        for _ in range(STEPS + 5):
            loss = model(torch.randn(4, 3, 8, 8, generator=generator)).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return model, losses

    _, plain = run()
    autogaudi.enable(
        device="cpu",
        only="step_profiler,mixed_precision,graph_capture,channels_last",
        force="graph_capture,channels_last",
        precision="bf16",
    )
    model, losses = run()
    report = autogaudi.report()
    for name in ("mixed_precision", "graph_capture", "channels_last"):
        assert report.unit(name)["reason_code"] == "fsdp2", report.unit(name)
    assert route_of(model) is None
    assert losses == plain
