"""Ten SGD steps on a linear model; prints the final loss. TRAIN=0 imports torch but does not train.
MODEL=mlp: ten AdamW steps on a 12-layer MLP instead, many small parameter tensors whose update
torch's fused kernel does several times faster than its unfused one on the CPU."""

import os

import torch

if os.environ.get("TRAIN", "1") == "1":
    torch.manual_seed(0)
    if os.environ.get("MODEL") == "mlp":
        model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(11)), torch.nn.Linear(4, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(10):
        loss = model(torch.ones(8, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"loss {loss.item():.8f}")
