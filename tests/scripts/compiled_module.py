"""A script that compiles its own model in the ways its arguments name, one model each, in their
order: ``torch_compile`` (before the first call), ``method`` (``module.compile()``) or ``late``
(``torch.compile`` of a model already trained two steps: dynamo imported only then, where it is
the first). The eager backend: what is tested is the call, not a compiler."""

import sys

import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x)


def train(how: str) -> None:
    torch.manual_seed(0)
    model = Net()
    if how == "torch_compile":
        model = torch.compile(model, backend="eager")
    elif how == "method":
        model.compile(backend="eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        if how == "late" and step == 2:
            model = torch.compile(model, backend="eager")
        loss = model(torch.randn(8, 4)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"{how} loss {loss.item():.6f}")


for how in sys.argv[1:]:
    train(how)
