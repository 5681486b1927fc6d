"""Attention written out by hand (softmax(q @ k^T / sqrt(d)) @ v), and the same through SDPA."""

import math

import torch
from torch import nn


class HandAttention(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, inputs):
        q, k, v = self.qkv(inputs).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        weights = torch.softmax(scores, dim=-1)  # doctor: manual_attention
        return weights @ v


class SdpaAttention(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, inputs):
        q, k, v = self.qkv(inputs).chunk(3, dim=-1)
        return nn.functional.scaled_dot_product_attention(q, k, v)


torch.manual_seed(0)
model = nn.Sequential(HandAttention(16), SdpaAttention(16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for _step in range(50):
    loss = model(torch.randn(8, 4, 16)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
