"""A model told the loop's step as a Python int (a schedule inside forward): a new constant each step."""

import torch
from torch import nn


class Scheduled(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 4)

    def forward(self, inputs, step):
        return self.body(inputs) * (1.0 + 0.01 * step)


torch.manual_seed(0)
model = Scheduled()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(50):
    loss = model(torch.randn(8, 16), step).pow(2).mean()  # doctor: python_scalar
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
