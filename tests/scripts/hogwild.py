"""pytorch/examples' mnist_hogwild, tiny: a model in shared memory, trained by two processes at once
(``mp.Process(target=train, args=(rank, model))``), each building its own optimizer. START_METHOD
(fork, spawn; default fork) picks how they start. Prints the parameters' checksum."""

import os

import torch
import torch.multiprocessing as mp
from torch import nn

PROCESSES, STEPS = 2, 30


def train(rank, model):
    torch.manual_seed(rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        inputs, targets = torch.randn(16, 8), torch.randn(16, 1)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        for _ in range(4):
            model(torch.randn(16, 8))


if __name__ == "__main__":
    mp.set_start_method(os.environ.get("START_METHOD", "fork"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    model.share_memory()
    processes = [mp.Process(target=train, args=(rank, model)) for rank in range(PROCESSES)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
        assert process.exitcode == 0, process.exitcode
    print("trained", all(bool(torch.isfinite(param).all()) for param in model.parameters()))
