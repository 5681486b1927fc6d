"""W1: the MNIST-sized MLP (784-128-10, dropout, batch 200, AdamW) on synthetic data."""

import argparse

import torch
from timing import DEVICE, add_arguments, report_steps
from torch import nn


def main():
    parser = argparse.ArgumentParser()
    add_arguments(parser, steps=300, warmup=40, gpu_steps=2000)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10)).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if args.hand_tuned else {}))
    total = args.steps + args.warmup
    images, labels = torch.randn(total, 200, 784), torch.randint(0, 10, (total, 200))

    def step(index):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images[index].to(DEVICE)), labels[index].to(DEVICE))
        loss.backward()
        optimizer.step()
        return loss.item()

    report_steps(step, args.warmup, args.steps)


if __name__ == "__main__":
    main()
