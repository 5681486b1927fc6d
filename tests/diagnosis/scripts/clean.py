"""No findings: static shapes, no reads in the loop, bf16 autocast, multiples of 8/64."""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
batches = [(torch.randn(64, 64), torch.randint(0, 8, (64,))) for _ in range(8)]
total = torch.zeros(())
for _epoch in range(100):
    for inputs, labels in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        total += loss.detach()
print(f"mean loss {total.item() / 800:.4f}")
