"""Ten AdamW steps on a 12-layer MLP: many small parameter tensors, whose update torch's fused kernel
does several times faster than its unfused one on the CPU; prints the final loss."""

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(12)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(10):
    loss = model(torch.ones(8, 16)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"loss {loss.item():.8f}")
