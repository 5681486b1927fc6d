"""W4: the W1 MLP fed by a Dataset that spends ~0.3 ms of CPU per sample building it
(measured: plain W4 runs at 15 steps/s with batch 200, ~95% of it waiting for data).

Prints one JSON line: steps/s from batch ``--steady-from`` on (default: the second epoch; autogaudi
measures 18 batches and has workers from the 19th, in the same epoch) and, separately, the whole
run's wall time. ``--epochs 1`` with more batches is the one-long-epoch case (streaming, LLM runs).
"""

import argparse
import json
import os
import time

import torch
from timing import DEVICE
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Augmented(Dataset):
    """Deterministic per-sample CPU work (no random draws), like decoding plus fixed transforms."""

    def __init__(self, samples: int):
        generator = torch.Generator().manual_seed(0)
        self.base = torch.randn(samples, 784, generator=generator)
        self.labels = torch.randint(0, 10, (samples,), generator=generator)
        self.mix = torch.randn(28, 28, generator=generator) / 28

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        image = self.base[index].view(28, 28)
        for _ in range(12):
            image = torch.tanh(image @ self.mix + image)
        return image.flatten(), self.labels[index]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batches", type=int, default=20, help="batches per epoch")
    parser.add_argument("--steady-from", type=int, help="first batch of the timed steady state (default: epoch 2)")
    parser.add_argument(
        "--hand-tuned",
        action="store_true",
        help="what an expert writes by hand: workers (2, or up to 8 on a bigger host), "
        "one main-process thread, pinned memory when there is a GPU",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.hand_tuned:
        torch.set_num_threads(1)
    tuned = {"num_workers": max(2, min(8, (os.cpu_count() or 2) - 1)), "pin_memory": DEVICE.type == "cuda"}
    loader = DataLoader(
        Augmented(200 * args.batches), batch_size=200, shuffle=True, **(tuned if args.hand_tuned else {})
    )
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10)).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    steady_from = args.batches if args.steady_from is None else args.steady_from
    start = time.perf_counter()
    for _ in range(args.epochs):
        for images, labels in loader:
            if len(losses) == steady_from:
                steady_start = time.perf_counter()
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(images.to(DEVICE)), labels.to(DEVICE))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    end = time.perf_counter()
    print(
        json.dumps(
            {
                "steps_per_s": (len(losses) - steady_from) / (end - steady_start),
                "total_seconds": end - start,
                "losses": losses,
            }
        )
    )


if __name__ == "__main__":
    main()
