"""Trains a few steps (STEPS, 12 by default), saves a checkpoint beside the user's own files, prints
its loss, then leaves the way EXIT says: normal, exception, sys_exit, os_exit, sigint, sigterm or sigkill."""

import os
import signal
import sys

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
for _ in range(int(os.environ.get("STEPS", "12"))):
    loss = model(torch.ones(4, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
torch.save(model.state_dict(), "checkpoint.pt")
print(f"loss {loss.item():.6f}", flush=True)

how = os.environ.get("EXIT", "normal")
if how == "exception":
    raise ValueError("the script's own error")
if how == "sys_exit":
    sys.exit(3)
if how == "os_exit":
    os._exit(4)
if how in ("sigint", "sigterm", "sigkill"):
    os.kill(os.getpid(), getattr(signal, how.upper()))
