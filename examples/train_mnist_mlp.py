"""A plain PyTorch training script, written as anyone would, with nothing autogaudi-specific.

An MNIST-sized MLP (784-128-10 with dropout, AdamW) on synthetic digits that the dataset builds and
augments sample by sample (noise, a blur, an elastic distortion, a random rotation and scale, a shift,
normalisation), as a dataset that decodes and augments images does: the step waits for the data loader
(about 30 ms of CPU a batch on a 2-core x86_64 CPU) far longer than the model computes (about 3 ms), the
case autogaudi's loader_workers measures and fixes with worker processes. No downloads. Run it directly
or under autogaudi and compare:

    python examples/train_mnist_mlp.py
    python -m autogaudi examples/train_mnist_mlp.py
"""

import argparse
import math

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class AugmentedDigits(Dataset):
    """Ten smooth class prototypes in 28x28; each sample is built from its own seeded generator (the
    same image whichever process builds it) and augmented on the CPU when it is asked for."""

    def __init__(self, samples: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        prototypes = torch.randn(10, 1, 28, 28, generator=generator)
        self.prototypes = 3.0 * nn.functional.avg_pool2d(prototypes, 5, stride=1, padding=2)
        self.labels = torch.randint(0, 10, (samples,), generator=generator)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = int(self.labels[index])
        image = self.prototypes[label] + torch.randn(1, 28, 28, generator=generator)
        image = nn.functional.avg_pool2d(image, 3, stride=1, padding=1, count_include_pad=False)
        # an elastic distortion (Simard et al., 2003): a random displacement field, smoothed, moves each pixel
        field = 2 * torch.rand(1, 2, 28, 28, generator=generator) - 1
        for _ in range(3):  # three box blurs: about a Gaussian's smoothing
            field = nn.functional.avg_pool2d(field, 9, stride=1, padding=4, count_include_pad=False)
        identity = nn.functional.affine_grid(torch.eye(2, 3)[None], (1, 1, 28, 28), align_corners=False)
        grid = identity + 0.3 * field.permute(0, 2, 3, 1)
        image = nn.functional.grid_sample(image[None], grid, align_corners=False)[0]
        # a random rotation (up to 15 degrees) and scale (up to 10%), then a shift of up to 2 pixels
        angle, scale = (torch.rand(2, generator=generator) - 0.5).tolist()
        angle, scale = angle * math.pi / 6, 1 + 0.2 * scale
        cos, sin = scale * math.cos(angle), scale * math.sin(angle)
        theta = torch.tensor([[[cos, -sin, 0.0], [sin, cos, 0.0]]])
        grid = nn.functional.affine_grid(theta, (1, 1, 28, 28), align_corners=False)
        image = nn.functional.grid_sample(image[None], grid, align_corners=False)[0]
        shift = torch.randint(-2, 3, (2,), generator=generator).tolist()
        image = torch.roll(image, shifts=shift, dims=(1, 2))
        image = (image - image.mean()) / (image.std() + 1e-6)
        return image.flatten(), label


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=6000)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="write a checkpoint (model and optimizer state) here")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loader = DataLoader(AugmentedDigits(args.samples, args.seed), batch_size=args.batch_size, shuffle=True)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10))
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        model.train()
        total, batches = 0.0, 0
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(images), labels)
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        print(f"epoch {epoch + 1}: mean loss {total / batches:.6f}")

    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.save)


if __name__ == "__main__":
    main()
