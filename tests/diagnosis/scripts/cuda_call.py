"""A script written for CUDA: its CUDA lines (mapped by the toolkit) and a CUDA-bound library."""

import torch
from torch import nn

try:
    import flash_attn  # noqa: F401  # doctor: cuda_call flash_attn
except ImportError:
    flash_attn = None

device = "cuda" if torch.cuda.is_available() else "cpu"  # doctor: cuda_call device
torch.manual_seed(0)
model = nn.Linear(16, 8).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
for _step in range(50):
    loss = model(torch.randn(8, 16, device=device)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if torch.cuda.is_available():  # doctor: cuda_call is_available
        torch.cuda.synchronize()
