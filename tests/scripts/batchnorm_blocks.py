"""Six residual blocks with BatchNorm1d and dropout, four SGD steps, then an evaluation forward:
every number a checkpointed recomputation could change (the losses, BatchNorm's counter and
running statistics, the evaluation output), printed exactly."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.dropout(torch.relu(self.norm(self.linear(x))))


class Net(nn.Module):
    def __init__(self, width=64, blocks=6):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


torch.manual_seed(0)
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.randn(256, 64)
for step in range(4):
    loss = model(data).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print("loss", step, loss.item().hex())
norm = model.blocks[0].norm
print("num_batches_tracked", int(norm.num_batches_tracked))
print("running_mean", float(sum(block.norm.running_mean.sum() for block in model.blocks)).hex())
model.eval()
with torch.no_grad():
    print("eval", float(model(data).sum()).hex())
