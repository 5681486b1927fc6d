"""Reads device values every step: .item(), a condition, .tolist(), print. Prints each step's loss
(for the numerics check) and writes a file after the loop (for the stop check)."""

import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
generator = torch.Generator().manual_seed(1)
for step in range(50):
    inputs, labels = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
    outputs = model(inputs)
    loss = nn.functional.cross_entropy(outputs, labels)
    optimizer.zero_grad()
    loss.backward()
    print(f"step {step} loss {loss.item():.8f}")  # doctor: host_sync item
    if loss > 100:  # doctor: host_sync condition
        break
    predictions = outputs.argmax(1).tolist()  # doctor: host_sync tolist
    optimizer.step()
with open(sys.argv[1], "w") as done:
    done.write("finished")
