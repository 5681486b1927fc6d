"""A loader-bound script that sets the spawn start method at top level with no
``if __name__ == "__main__":`` guard, so a spawned worker re-running it dies ("context has already
been set"); its dataset pickles larger than a pipe's buffer, so starting such a worker blocks. The
plain run never starts one. 120 ms asleep per batch against a step of a few ms: measured starved
(and so checked for workers) by a wide margin on a loaded machine too. Prints its losses as JSON."""

import json
import time

import torch
import torch.multiprocessing
from torch.utils.data import DataLoader, Dataset

torch.multiprocessing.set_start_method("spawn")


class Slow(Dataset):
    def __init__(self):
        self.labels = list(range(100_000))

    def __len__(self):
        return 24 * 4

    def __getitem__(self, index):
        time.sleep(0.03)
        return torch.full((8,), index / len(self)), self.labels[index] % 3


torch.manual_seed(0)
model = torch.nn.Linear(8, 3)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(Slow(), batch_size=4, shuffle=True)
losses = []
for features, labels in loader:
    loss = torch.nn.functional.cross_entropy(model(features), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
print(json.dumps({"losses": losses}))
