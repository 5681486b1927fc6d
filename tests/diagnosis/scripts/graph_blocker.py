import torch
from torch import nn


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 4)

    def forward(self, inputs):
        if inputs.mean() > 0:  # doctor: graph_blocker
            return self.body(inputs)
        return self.body(-inputs)


torch.manual_seed(0)
model = Gated()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for _step in range(50):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
