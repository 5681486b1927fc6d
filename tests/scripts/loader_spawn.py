"""A loader-bound script using the spawn start method, its Dataset defined here (so workers must
unpickle it from __main__). Prints its losses and each epoch's num_workers as JSON."""

import json
import multiprocessing
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    """80 ms asleep per batch: starving a step of a few ms by a wide margin on a loaded machine too
    (at 24 ms, a step slowed to 7 ms beside pytest read 80% waiting; slowed more, not starved)."""

    def __len__(self):
        return 24 * 8

    def __getitem__(self, index):
        time.sleep(0.01)
        return torch.full((8,), index / len(self)), index % 3


if __name__ == "__main__":
    multiprocessing.set_start_method("spawn")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Slow(), batch_size=8, shuffle=True)
    losses, workers = [], []
    for _ in range(3):
        workers.append(loader.num_workers)
        for features, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(features), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    print(json.dumps({"losses": losses, "workers": workers}))
