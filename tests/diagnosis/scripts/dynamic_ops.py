import torch
from torch import nn


class Sparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16)

    def forward(self, inputs):
        hidden = self.body(inputs)
        return hidden[hidden > 0].sum()  # doctor: dynamic_ops


torch.manual_seed(0)
model = Sparse()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _step in range(50):
    loss = model(torch.randn(8, 16))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
