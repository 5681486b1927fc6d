"""W1: the MNIST-sized MLP (784-128-10, dropout, batch 200, AdamW) on synthetic data.

Prints one JSON line: steady-state steps/s (after warm-up, timed inside the process so interpreter
and torch start-up are excluded) and the loss of every step, so a run that trains differently is
caught by the harness.
"""
import argparse
import json
import time

import torch
from torch import nn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    images = torch.randn(args.steps + args.warmup, 200, 784)
    labels = torch.randint(0, 10, (args.steps + args.warmup, 200))
    losses = []
    for step in range(args.steps + args.warmup):
        if step == args.warmup:
            start = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model(images[step]), labels[step])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - start
    print(json.dumps({"steps_per_s": args.steps / elapsed, "losses": losses}))


if __name__ == "__main__":
    main()
