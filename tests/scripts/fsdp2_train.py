"""FSDP2 on gloo: a tiny stack of blocks, ``fully_shard`` per block and at the root, explicit
prefetching, Adam, ``clip_grad_norm_``, and two micro-batches per step (gradient sync off for the
first). After STEPS steps it saves model and optimizer with torch.distributed.checkpoint (DCP),
loads them into a freshly built, differently initialised model and optimizer, and trains STEPS_AFTER
more steps there (the checkpoint: $RESULTS/dcp). Rank 0 also writes the full state dict at the end
with plain ``torch.save`` ($RESULTS/full.pt).

Each rank writes its losses, the full parameters' checksum, whether autogaudi is on in it and its
units' report rows, as JSON, to $RESULTS/rank<N>.json (ranks share stdout: their lines interleave).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard


def build(seed):
    torch.manual_seed(seed)
    blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3)]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(8, 1))
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    blocks[0].set_modules_to_forward_prefetch([blocks[1]])
    blocks[2].set_modules_to_backward_prefetch([blocks[1]])
    return model, torch.optim.Adam(model.parameters(), lr=0.02)


def train(model, optimizer, generator, steps, losses):
    for _ in range(steps):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            loss = model(torch.randn(4, 8, generator=generator)).pow(2).mean()
            loss.backward()
            losses.append(round(loss.item(), 6))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()


def full_checksum(model):
    return [round(float(p.detach().full_tensor().double().sum()), 6) for p in model.parameters()]


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checkpoint = os.path.join(os.environ["RESULTS"], "dcp")
    generator = torch.Generator().manual_seed(rank)
    losses = []
    model, optimizer = build(0)
    train(model, optimizer, generator, int(os.environ.get("STEPS", "15")), losses)
    saved = full_checksum(model)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint)

    model, optimizer = build(1)  # other weights, no optimizer state: all of it must come from the checkpoint
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    reloaded = full_checksum(model)
    train(model, optimizer, generator, int(os.environ.get("STEPS_AFTER", "3")), losses)

    full = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))[0]
    if rank == 0:
        torch.save(full, os.path.join(os.environ["RESULTS"], "full.pt"))
    runtime = sys.modules.get("autogaudi.entry.runtime")
    result = {
        "rank": rank,
        "losses": losses,
        "saved": saved,
        "reloaded": reloaded,
        "checksum": full_checksum(model),
        "autogaudi": runtime.is_enabled() if runtime else False,
        "units": {row["name"]: row for row in runtime.report().as_dict()["units"]} if runtime else {},
    }
    with open(os.path.join(os.environ["RESULTS"], f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
