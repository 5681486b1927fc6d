"""Common script shapes whose numbers a tool can change without a word (python numerics_shapes.py
SHAPE); each prints one JSON line with every loss (hex), a digest of the final parameters, the
global random streams, and what the script can observe of its own set-up afterwards.

- ``augment``: a slow dataset that augments with its own ``numpy.random.RandomState`` (workers
  would each replay a copy of it);
- ``counting``: a slow dataset that counts its calls and caches items in ``__getitem__`` (workers
  would count and cache in their copies);
- ``precision``: a matmul-bound MLP long enough for ``--precision auto`` to check and try bf16;
- ``dropout``: a host-bound MLP with dropout (a capture trial would compile its dropout).

The optimizers take ``foreach=False`` (the script's own choice, which the fused optimizer leaves
alone), so the only differences left are the shape's own.
"""

import hashlib
import json
import random
import sys
import time

import numpy
import torch


def digest(*parts) -> str:
    hashed = hashlib.sha256()
    for part in parts:
        hashed.update(part.detach().contiguous().numpy().tobytes() if torch.is_tensor(part) else repr(part).encode())
    return hashed.hexdigest()[:16]


class Augmenting(torch.utils.data.Dataset):
    def __init__(self):
        self.rng = numpy.random.RandomState(123)
        self.data = torch.randn(256, 16)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        time.sleep(0.01)  # building an item takes longer than the step: the loader starves it
        return self.data[index] + float(self.rng.normal(0.0, 0.1)), index % 3


class Counting(torch.utils.data.Dataset):
    def __init__(self):
        self.count = 0
        self.cache = {}
        self.data = torch.randn(256, 16)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        time.sleep(0.01)
        self.count += 1
        if index not in self.cache:
            self.cache[index] = self.data[index] * 2
        return self.cache[index], index % 3


def loader_run(dataset, epochs=2):
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, foreach=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True)
    losses = []
    for _ in range(epochs):
        for inputs, labels in loader:
            loss = torch.nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item().hex())
    seen = {"threads": torch.get_num_threads(), "num_workers": loader.num_workers}
    for name in ("count", "cache"):
        if hasattr(dataset, name):
            value = getattr(dataset, name)
            seen[name] = len(value) if isinstance(value, dict) else value
    return model, losses, seen


def step_run(model, steps, batch, width):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        inputs = torch.randn(batch, width, generator=generator)
        labels = torch.randint(0, 3, (batch,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item().hex())
    model.eval()
    with torch.no_grad():  # the final evaluation the user compares against a baseline
        evaluation = model(torch.randn(64, width, generator=generator)).sum().item().hex()
    return model, losses, {"evaluation": evaluation}


def main(shape: str) -> None:
    torch.manual_seed(0)
    random.seed(0)
    numpy.random.seed(0)
    if shape == "augment":
        model, losses, seen = loader_run(Augmenting())
    elif shape == "counting":
        model, losses, seen = loader_run(Counting())
    elif shape == "precision":
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 3))
        model, losses, seen = step_run(model, steps=120, batch=128, width=256)
    else:
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 3)
        )
        model, losses, seen = step_run(model, steps=int(sys.argv[2]) if len(sys.argv) > 2 else 60, batch=8, width=16)
    streams = {
        "torch": digest(torch.get_rng_state()),
        "random": digest(random.getstate()),
        "numpy": digest(numpy.random.get_state()[1]),
    }
    print(json.dumps({"losses": losses, "parameters": digest(*model.parameters()), "streams": streams, **seen}))


if __name__ == "__main__":
    main(sys.argv[1])
