"""W5: W1's MLP, without its dropout, trained by DistributedDataParallel on gloo, one process per
rank (run it under torchrun: benchmarks/run.py uses 2 ranks). Each rank takes its own half of the
batch of 200; rank 0 prints the figures (its own losses: every rank's differ, its data does).

No dropout, so that the loss check speaks about gradient averaging (fast_ddp) and not about compiled
dropout's random stream. 1500 timed steps: two ranks, the torchrun agent and 2 cores make shorter
windows too noisy to read (a 300-step run spread 0.85-1.3x between identical variants)."""

import argparse

import torch
import torch.distributed as dist
from timing import add_arguments, report_steps
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main():
    parser = argparse.ArgumentParser()
    add_arguments(parser, steps=1500, warmup=40)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    # Hand-tuned: what ddp_tuning sets, written out, and the fused optimizer.
    model = DistributedDataParallel(
        model, **({"gradient_as_bucket_view": True, "broadcast_buffers": False} if args.hand_tuned else {})
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **({"fused": True} if args.hand_tuned else {}))
    total = args.steps + args.warmup
    generator = torch.Generator().manual_seed(rank)
    images = torch.randn(total, 200 // world, 784, generator=generator)
    labels = torch.randint(0, 10, (total, 200 // world), generator=generator)

    def step(index):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(images[index]), labels[index])
        loss.backward()
        optimizer.step()
        return loss.item()

    if rank == 0:
        report_steps(step, args.warmup, args.steps)
    else:
        for index in range(total):
            step(index)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
