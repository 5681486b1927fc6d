"""W2: a small transformer encoder classifier (4 layers, d_model 256, seq 128, AdamW + clip).

Compute-bound, and fed through a plain DataLoader so that autogaudi's loader measurement runs on it
too (and must leave the loader alone: "no harm")."""

import argparse

import torch
from timing import DEVICE, add_arguments, report_steps
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(nn.Module):
    def __init__(self, vocab=1000, d_model=256, layers=4, classes=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, 4, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(dim=1))


def main():
    parser = argparse.ArgumentParser()
    add_arguments(parser, steps=20, warmup=14, gpu_steps=500)  # warm-up holds autogaudi's 13 profiled steps
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--autocast", action="store_true", help="bf16 autocast around forward and loss, by hand")
    parser.add_argument(
        "--fp16", action="store_true", help="fp16 autocast around forward and loss and a GradScaler, by hand"
    )
    parser.add_argument("--tf32", action="store_true", help="CUDA's TF32 matmul and cuDNN switches on, by hand")
    parser.add_argument(
        "--overflow-at",
        type=int,
        metavar="STEP",
        help="multiply the gradient at the model's output by 1e4 in this step: fp16's loss scaling must skip it",
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    model = Classifier().to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, **({"fused": True} if args.hand_tuned else {}))
    total = args.steps + args.warmup
    data = TensorDataset(torch.randint(0, 1000, (total * args.batch, 128)), torch.randint(0, 8, (total * args.batch,)))
    batches = iter(DataLoader(data, batch_size=args.batch))
    dtype = torch.float16 if args.fp16 else torch.bfloat16
    scaler = torch.amp.GradScaler(DEVICE.type, enabled=args.fp16)

    def step(index):
        tokens, labels = next(batches)
        optimizer.zero_grad()
        with torch.autocast(DEVICE.type, dtype=dtype, enabled=args.autocast or args.fp16):
            output = model(tokens.to(DEVICE))
            if index == args.overflow_at:  # the loss stays as it is: an overflow only the gradients show
                output.register_hook(lambda grad: grad * 1e4)
            loss = nn.functional.cross_entropy(output, labels.to(DEVICE))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        return loss.item()

    report_steps(step, args.warmup, args.steps)


if __name__ == "__main__":
    main()
