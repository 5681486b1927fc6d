"""A script written for Gaudi as Intel's examples are: the bridge imported before torch, ``device =
"hpu"``, ``mark_step()`` after backward and after the optimizer's step (a no-op in eager mode).
Prints how many parameters and batches report device hpu, the backend's mode and the final loss."""

import habana_frameworks.torch.core as htcore  # first, as Intel's examples put it
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
device = torch.device("hpu")
data = TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
loader = DataLoader(data, batch_size=8, shuffle=False)
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
batches = []
for inputs, targets in loader:
    inputs, targets = inputs.to(device), targets.to(device)
    batches += [inputs, targets]
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    optimizer.zero_grad()
    loss.backward()
    htcore.mark_step()
    optimizer.step()
    htcore.mark_step()
for kind, tensors in {"parameters": list(model.parameters()), "batches": batches}.items():
    print(f"{kind} on hpu {sum(t.device.type == 'hpu' for t in tensors)} of {len(tensors)}")
print(f"lazy {htcore.is_lazy()}")
print(f"loss {loss.item():.8f}")
