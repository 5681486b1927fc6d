"""A model whose forward the script watches: it prints from its forward and its blocks', a forward
hook keeps the head's outputs (stacked and summed at the end), and each block skips itself at random
with Python's ``random`` (stochastic depth). Whatever runs the script's code more often than plain
(on fake tensors, or again in backward) shows in the output."""

import random

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width, index):
        super().__init__()
        self.index = index
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        if self.training and random.random() < 0.25:
            print("skipped block", self.index)
            return x
        print("block", self.index)
        return x + self.dropout(torch.tanh(self.linear(x)))


class Net(nn.Module):
    def __init__(self, width=64, blocks=4):
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
