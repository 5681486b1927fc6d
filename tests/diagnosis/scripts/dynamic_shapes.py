"""A sequence model fed batches padded to the longest sequence: the length changes every step."""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Embedding(100, 16), nn.Flatten(0, 1), nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(50):
    length = 5 + step % 7
    tokens = torch.randint(0, 100, (8, length))
    loss = model(tokens).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
