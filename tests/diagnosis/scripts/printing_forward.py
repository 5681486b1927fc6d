"""A tiny model that prints in its forward: a sample adds a few bytes, so a named device would fit
batches of billions; the doctor's projection must neither print again nor name such a batch."""

import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        print("forward called")
        for block in self.blocks:
            x = block(x)
        return x


torch.manual_seed(0)
net = Net()
optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
for _ in range(4):
    net(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
