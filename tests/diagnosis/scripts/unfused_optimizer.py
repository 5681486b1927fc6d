"""Optimizers without a Gaudi fused kernel: RMSprop, Adam with amsgrad, and Adagrad (hpex-only)."""

import torch
from torch import nn

torch.manual_seed(0)
models = [nn.Linear(16, 8) for _ in range(3)]
optimizers = [
    torch.optim.RMSprop(models[0].parameters(), lr=0.01),
    torch.optim.Adam(models[1].parameters(), lr=0.01, amsgrad=True),
    torch.optim.Adagrad(models[2].parameters(), lr=0.01),
]
for _step in range(50):
    for model, optimizer in zip(models, optimizers):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
