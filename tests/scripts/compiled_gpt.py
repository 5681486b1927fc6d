"""nanoGPT's shape, tiny: a custom module compiled by the script itself (``torch.compile(model)``,
the backend from BACKEND, inductor by default), an evaluation under ``@torch.no_grad()`` every few
iterations, AdamW; prints the losses."""

import os

import torch
from torch import nn

VOCAB, WIDTH = 16, 8


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx, targets=None):
        logits = self.lm_head(torch.tanh(self.wte(idx)))
        loss = None if targets is None else nn.functional.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))
        return logits, loss


def get_batch(generator):
    data = torch.randint(0, VOCAB, (4, 7), generator=generator)
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


torch.manual_seed(0)
generator = torch.Generator().manual_seed(0)
model = torch.compile(GPT(), backend=os.environ.get("BACKEND", "inductor"))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)


@torch.no_grad()
def estimate_loss():
    model.eval()
    _, loss = model(*get_batch(generator))
    model.train()
    return loss.item()


for iteration in range(int(os.environ.get("ITERATIONS", "32"))):
    if iteration % 10 == 0:
        print(f"iteration {iteration}: val loss {estimate_loss():.4f}")
    _, loss = model(*get_batch(generator))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
print(f"loss {loss.item():.4f}")
