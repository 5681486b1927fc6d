"""A plain Accelerator loop as the accelerate docs write it: prepare() wraps the model (DDP when
launched with several processes), the optimizer and the DataLoader; accumulate() and backward()
handle gradient accumulation (no_sync), clip_grad_norm_ clips. Each process writes its losses and,
under autogaudi, its report rows to $RESULTS/rank<N>.json."""

import json
import os
import sys

import torch
from accelerate import Accelerator


def main():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(256, 20, generator=generator), torch.randint(0, 2, (256,), generator=generator)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True, generator=generator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for _epoch in range(2):
        for inputs, labels in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(inputs), labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    runtime = sys.modules.get("autogaudi.entry.runtime")
    result = {
        "rank": accelerator.process_index,
        "losses": losses,
        "checksum": [round(float(p.detach().double().sum()), 6) for p in model.parameters()],
        "units": {row["name"]: row for row in runtime.report().as_dict()["units"]} if runtime else {},
    }
    with open(os.path.join(os.environ["RESULTS"], f"rank{accelerator.process_index}.json"), "w") as handle:
        json.dump(result, handle)
    accelerator.end_training()


if __name__ == "__main__":
    main()
