"""A script that trains on the host only, naming no accelerator: the model built and trained where
torch puts it by default. Prints where the model's parameters are and the final loss."""

import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
data = TensorDataset(torch.randn(50, 4), torch.randn(50, 1))  # 50 % 8: a short last batch
loader = DataLoader(data, batch_size=8, shuffle=False)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _epoch in range(2):
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
print(f"model on {next(model.parameters()).device}")
print(f"loss {loss.item():.8f}")
