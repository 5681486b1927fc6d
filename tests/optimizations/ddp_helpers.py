"""What the DDP units' tests share: a tiny model, a training loop, and a 2-rank torchrun job."""

import json

import torch

from tests.helpers import clean_env, run_ranks


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def train(model, steps=10):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # SGD's fused kernel is off (only=...)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 6, generator=generator)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def torchrun(tmp_path, *args, env=None, **extra):
    """Run a 2-rank job; return (CompletedProcess, each rank's result, by rank)."""
    results = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    results.mkdir()
    result = run_ranks(*args, env=clean_env(RESULTS=results, **(env or {})), **extra)
    rows = [json.loads(path.read_text()) for path in sorted(results.glob("rank*.json"))]
    return result, rows


TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2")
# A plain job's launch as the ``torchrun`` console script runs it (its own code, as -c): the pre-started
# interpreter forks that agent (tests/prestarted.py), where ``-m torch.distributed.run`` starts a real
# one to import torch again; its ranks start as they would. For jobs whose launch form is not the test's.
PLAIN_TORCHRUN = ("-c", "import sys; from torch.distributed.run import main; sys.exit(main())", *TORCHRUN[2:])
