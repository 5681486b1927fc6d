"""A text classifier trained on dict batches (input_ids, attention_mask, labels) padded per batch to
their longest sequence, as Hugging Face's DataCollatorWithPadding pads them: lengths 8-64, seeded.
POOL=masked (default) averages the token features over the mask; POOL=unmasked averages over every
position, padding included (its result moves with padding). EPOCHS (default 2). Prints every
step's loss (repr) and, at the end, the test set's loss (its batches padded the same way)."""

import os

import torch
from torch.utils.data import DataLoader

VOCAB, WIDTH, CLASSES, SAMPLES, BATCH = 1000, 64, 4, 512, 16
POOL = os.environ.get("POOL", "masked")


def samples(count: int, generator) -> list:
    lengths = torch.randint(8, 65, (count,), generator=generator)
    out = []
    for length in lengths.tolist():
        ids = torch.randint(1, VOCAB, (length,), generator=generator)
        out.append({"input_ids": ids, "labels": int(ids[:4].sum()) % CLASSES})
    return out


def collate(batch: list) -> dict:
    longest = max(len(item["input_ids"]) for item in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros(len(batch), longest, dtype=torch.long)
    for row, item in enumerate(batch):
        ids[row, : len(item["input_ids"])] = item["input_ids"]
        mask[row, : len(item["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([item["labels"] for item in batch])}


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH, padding_idx=0)
        self.mix = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH))
        self.head = torch.nn.Linear(WIDTH, CLASSES)

    def forward(self, input_ids, attention_mask):
        tokens = self.mix(self.embed(input_ids))
        if POOL == "unmasked":
            pooled = tokens.mean(dim=1)
        else:
            mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1)
        return self.head(pooled)


def main() -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    train = DataLoader(samples(SAMPLES, generator), batch_size=BATCH, shuffle=True, collate_fn=collate)
    test = DataLoader(samples(BATCH * 4, generator), batch_size=BATCH, collate_fn=collate)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(int(os.environ.get("EPOCHS", "2"))):
        for batch in train:
            logits = model(batch["input_ids"], batch["attention_mask"])
            loss = torch.nn.functional.cross_entropy(logits, batch["labels"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"loss {loss.item()!r}")
    with torch.no_grad():
        total = sum(
            torch.nn.functional.cross_entropy(model(b["input_ids"], b["attention_mask"]), b["labels"]).item()
            for b in test
        )
    print(f"test {total / len(test)!r}")


if __name__ == "__main__":
    main()
