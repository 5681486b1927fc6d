"""A small GPT for the memory tests: token and position embeddings, a ModuleList of identical
transformer blocks (attention through scaled_dot_product_attention, an MLP, dropout), a head, and
the loss computed inside the forward, as minGPT does."""

import itertools

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, CONTEXT = 128, 64, 4, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        batch, length, width = x.shape
        heads = [t.view(batch, length, HEADS, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(width, 2)]
        attended = F.scaled_dot_product_attention(*heads, is_causal=True).transpose(1, 2).reshape(x.shape)
        x = x + self.drop(self.proj(attended))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, blocks=4):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, idx, targets):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, loss):
        return loss.clone()

    @staticmethod
    def backward(ctx, grad):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


class OutOfMemoryGPT(TinyGPT):
    """A TinyGPT that runs out of memory once, in its call number ``at`` (1-based): in its forward
    (after updating a buffer and drawing a block's dropout masks, as a real forward would have by
    then) or in the backward of that call's loss; ``error`` is what it raises."""

    def __init__(self, at=None, where="forward", error=None):
        super().__init__()
        self.register_buffer("calls_seen", torch.zeros(()))
        # a counter the rescue does not put back (it puts back the model's attributes): the failure is
        # injected once, as memory freed and blocks checkpointed keep a real one from coming back
        self.at, self.where, self.calls = at, where, itertools.count(1)
        self.error = error or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    def forward(self, idx, targets):
        fails = next(self.calls) == self.at
        self.calls_seen.add_(1)
        if fails and self.where == "forward":
            self.blocks[0](self.tokens(idx))
            raise self.error
        loss = super().forward(idx, targets)
        return _FailsInBackward.apply(loss) if fails and self.where == "backward" else loss


def train(steps=5, batch=16, make=TinyGPT, times=None):
    """Losses of ``steps`` AdamW steps of a seeded ``make()`` (a TinyGPT) on seeded batches (dropout
    on), and the model; ``times``, a list: each step's seconds appended (for the benchmarks)."""
    import time

    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (batch, CONTEXT), generator=generator)
        targets = torch.randint(0, VOCAB, (batch, CONTEXT), generator=generator)
        start = time.perf_counter()
        loss = model(idx, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if times is not None:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return losses, model
