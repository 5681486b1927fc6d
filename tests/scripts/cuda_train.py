"""A script written for CUDA, as public ones are: STYLE=examples picks its device the pytorch/examples
way (``"cuda" if torch.cuda.is_available() else "cpu"``), STYLE=dot calls ``.cuda()`` directly
(guarded the same way, so it also runs where nothing maps it), STYLE=host names CUDA but puts its model
on the CPU (as a script whose ``--device`` defaults to cpu). IMPORT_BRIDGE_FIRST=1 loads the Gaudi
bridge before torch, as a script of Gaudi's own would; ENABLE=first calls ``autogaudi.enable()``
before anything else, ENABLE=after_torch after ``import torch``. Its model
and helpers live in a local module (cuda_pkg/net.py), as scripts split them. Prints where the model's
parameters are and the final loss; with PLACEMENT=1, how many parameters and batches report device hpu."""

import os

if os.environ.get("ENABLE") == "first":
    import autogaudi

    autogaudi.enable()

if os.environ.get("IMPORT_BRIDGE_FIRST") == "1":  # as a script that loads the Gaudi bridge itself
    import habana_frameworks.torch  # noqa: F401

import torch
from cuda_pkg.net import Net, seeded
from torch.utils.data import DataLoader, TensorDataset

if os.environ.get("ENABLE") == "after_torch":
    import autogaudi

    autogaudi.enable()

STYLE = os.environ.get("STYLE", "examples")
placed = {"parameters": [], "batches": []}
seeded(0)
data = TensorDataset(torch.randn(50, 4), torch.randn(50, 1))  # 50 % 8: a short last batch
loader = DataLoader(data, batch_size=8, shuffle=False)
model = Net()
if STYLE in ("examples", "host"):
    device = torch.device("cuda" if torch.cuda.is_available() and STYLE == "examples" else "cpu")
    model = model.to(device)
else:
    device = None
    if torch.cuda.is_available():
        model = model.cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _epoch in range(2):
    for inputs, targets in loader:
        if STYLE == "dot" and torch.cuda.is_available():
            inputs, targets = inputs.cuda(), targets.cuda()
        elif device is not None:
            inputs, targets = inputs.to(device), targets.to(device)
        placed["batches"] += [inputs, targets]
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
print(f"model on {next(model.parameters()).device}")
if os.environ.get("PLACEMENT") == "1":
    for kind, tensors in {**placed, "parameters": list(model.parameters())}.items():
        print(f"{kind} on hpu {sum(t.device.type == 'hpu' for t in tensors)} of {len(tensors)}")
print(f"loss {loss.item():.8f}")
