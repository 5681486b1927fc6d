"""A small seeded training run that prints what its numbers are, bit for bit: every loss, a digest
of the final parameters, and a digest of each random stream the script draws from (torch, random,
numpy). Dropout, a shuffling DataLoader, Adam, and draws from random and numpy every step; the
model and batches on DEVICE (default the CPU)."""

import hashlib
import json
import os
import random

import numpy
import torch


def digest(*parts) -> str:
    hashed = hashlib.sha256()
    for part in parts:
        hashed.update(
            part.detach().cpu().contiguous().numpy().tobytes() if torch.is_tensor(part) else repr(part).encode()
        )
    return hashed.hexdigest()[:16]


torch.manual_seed(0)
random.seed(0)
numpy.random.seed(0)
data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randn(96, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
device = os.environ.get("DEVICE", "cpu")
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1))
model.to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
losses = []
for _ in range(2):
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        noise = random.gauss(0.0, 0.01) + float(numpy.random.normal(0.0, 0.01))
        loss = torch.nn.functional.mse_loss(model(inputs + noise), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item().hex())
streams = {
    "torch": digest(torch.get_rng_state()),
    "random": digest(random.getstate()),
    "numpy": digest(numpy.random.get_state()[1]),
}
print(json.dumps({"losses": losses, "parameters": digest(*model.parameters()), "streams": streams}))
