"""A small convolutional net trained for STEPS SGD steps on fixed random batches; prints the final loss."""

import os

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
inputs, labels = torch.randn(16, 3, 8, 8), torch.randint(0, 4, (16,))
for _ in range(int(os.environ.get("STEPS", "60"))):
    loss = nn.functional.cross_entropy(model(inputs), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"loss {loss.item():.6f}")
