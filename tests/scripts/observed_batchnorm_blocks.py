"""Residual blocks with BatchNorm1d and dropout that the script watches: each block prints, skips
itself at random with Python's ``random`` (stochastic depth), a forward hook keeps the head's
outputs; four SGD steps, then an evaluation forward. Every number a checkpointed recomputation or
a measurement could change (the losses, the draws, BatchNorm's counters and running statistics,
the hook's outputs, the evaluation output) is printed exactly, and whatever runs the script's code
more often than plain (on fake tensors, or again in backward) shows in the prints."""

import random

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width, index):
        super().__init__()
        self.index = index
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        if self.training and random.random() < 0.25:
            print("skipped block", self.index)
            return x
        print("block", self.index)
        return x + self.dropout(torch.relu(self.norm(self.linear(x))))


class Net(nn.Module):
    def __init__(self, width=64, blocks=6):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width, index) for index in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        print("forward", tuple(x.shape))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


random.seed(0)
torch.manual_seed(0)
model = Net()
acts = []
model.head.register_forward_hook(lambda module, args, output: acts.append(output.detach()))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.randn(256, 64)
for step in range(4):
    loss = model(data).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print("loss", step, loss.item().hex(), random.random().hex())
print("acts", len(acts), torch.stack(acts).sum().item().hex())
for block in model.blocks:
    norm = block.norm
    print("norm", block.index, int(norm.num_batches_tracked), float(norm.running_mean.sum()).hex())
model.eval()
with torch.no_grad():
    print("eval", float(model(data).sum()).hex())
