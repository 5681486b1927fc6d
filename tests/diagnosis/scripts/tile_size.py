"""A wide float32 MLP: a hidden size of 1000 and a batch of 12; no autocast."""

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 1000), nn.ReLU(), nn.Linear(1000, 256))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.TensorDataset(torch.randn(96, 256))
loader = torch.utils.data.DataLoader(data, batch_size=12)
for _epoch in range(10):
    for (inputs,) in loader:
        loss = model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
