"""Models ModuleCacher cannot capture: one with a module hook, one whose forward takes *args."""

import torch
from torch import nn


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 4)

    def forward(self, inputs):  # doctor: graph_blocker module_hooks
        return self.body(inputs)


class Starred(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 4)

    def forward(self, *inputs):  # doctor: graph_blocker positional_forward
        return self.body(inputs[0])


torch.manual_seed(0)
hooked, starred = Hooked(), Starred()
activations = []
hooked.body.register_forward_hook(lambda module, args, output: activations.append(output.shape))
optimizer = torch.optim.SGD([*hooked.parameters(), *starred.parameters()], lr=0.05)
for _step in range(50):
    loss = hooked(torch.randn(8, 16)).pow(2).mean() + starred(torch.randn(8, 16)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
