"""A plain PyTorch training script, written as anyone would, with nothing autogaudi-specific.

An MNIST-sized MLP (784-128-10 with dropout, batch 200, AdamW) on synthetic data, so that it runs
anywhere without downloads. Run it directly or under autogaudi and compare:

    python examples/train_mnist_mlp.py
    python -m autogaudi examples/train_mnist_mlp.py
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def synthetic_mnist(samples: int, seed: int) -> TensorDataset:
    """Ten noisy class prototypes in 784 dimensions: learnable, like MNIST, but generated."""
    generator = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(10, 784, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    images = prototypes[labels] + 5.0 * torch.randn(samples, 784, generator=generator)
    return TensorDataset(images, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=12000)
    parser.add_argument("--batch-size", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="write a checkpoint (model and optimizer state) here")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loader = DataLoader(synthetic_mnist(args.samples, args.seed), batch_size=args.batch_size, shuffle=True)
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
