"""W3: a small CNN with BatchNorm on 32x32 images (CIFAR-sized, synthetic), SGD with momentum.

The workload where memory format matters: the hand-tuned script converts model and inputs to
channels_last, which the HF single-GPU guide recommends for convolutions."""

import argparse

import torch
from timing import DEVICE, add_arguments, report_steps
from torch import nn


def block(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU())


def main():
    parser = argparse.ArgumentParser()
    add_arguments(parser, steps=30, warmup=40, gpu_steps=500)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(
        block(3, 32),
        block(32, 64),
        nn.MaxPool2d(2),
        block(64, 128),
        nn.MaxPool2d(2),
        block(128, 128),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(128, 10),
    ).to(DEVICE)
    layout = torch.channels_last if args.hand_tuned else torch.contiguous_format
    model = model.to(memory_format=layout)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=0.05, momentum=0.9, **({"fused": True} if args.hand_tuned else {})
    )
    total = args.steps + args.warmup
    images, labels = torch.randn(total, args.batch, 3, 32, 32), torch.randint(0, 10, (total, args.batch))

    def step(index):
        optimizer.zero_grad()
        inputs = images[index].to(DEVICE).contiguous(memory_format=layout)
        loss = nn.functional.cross_entropy(model(inputs), labels[index].to(DEVICE))
        loss.backward()
        optimizer.step()
        return loss.item()

    report_steps(step, args.warmup, args.steps)


if __name__ == "__main__":
    main()
