"""Ten DDP steps on gloo with rank-specific data; each rank writes its parameters' checksum (and a
digest of their bytes, for bitwise comparisons), whether
autogaudi is on in it and, if so, its units' report rows, as JSON, to $RESULTS/rank<N>.json (a file
each: ranks share stdout and their lines can interleave).

Knobs (environment): FAIL_RANK=N makes rank N raise after its first step. ACCUMULATE=K runs K
micro-batches per step, all but the last inside ``no_sync()``. CLIP=1 clips the gradient norm before
the step (it must see averaged gradients). BRANCH=rank1 adds a layer only rank 1 uses;
BRANCH=from_step5 one that every rank uses from step 5 on (both need find_unused_parameters).
STEPS=N trains N steps (default 10). SLOW_DATA_RANK=N feeds rank N from a DataLoader that sleeps
SLOW_DATA_MS (default 18) a step, a quarter per sample, so that rank measures itself input-bound.
SLOW_HOST_RANK=N makes rank N spend SLOW_HOST_MS (default 20) of Python before each forward, so that
it measures itself host-bound and the other ranks wait for it in the all-reduce.
"""

import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.branch = torch.nn.Linear(6, 1)

    def forward(self, x, use_branch=False):
        out = self.body(x)
        return out + self.branch(x) if use_branch else out


class SlowData(torch.utils.data.Dataset):
    def __init__(self, generator, samples, seconds_each):
        self.samples = torch.randn(samples, 6, generator=generator)
        self.seconds_each = seconds_each

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        time.sleep(self.seconds_each)
        return self.samples[index]


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    branch = os.environ.get("BRANCH", "")
    accumulate = int(os.environ.get("ACCUMULATE", "1"))
    torch.manual_seed(0)
    model = (
        DistributedDataParallel(Net(), find_unused_parameters=True) if branch else DistributedDataParallel(Net().body)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    steps = int(os.environ.get("STEPS", "10"))
    batches = None
    if os.environ.get("SLOW_DATA_RANK") == str(rank):
        data = SlowData(generator, 4 * steps * accumulate, float(os.environ.get("SLOW_DATA_MS", "18")) / 4000)
        batches = iter(torch.utils.data.DataLoader(data, batch_size=4))
    host_seconds = float(os.environ.get("SLOW_HOST_MS", "20")) / 1000
    for step in range(steps):
        if os.environ.get("SLOW_HOST_RANK") == str(rank):
            busy_until = time.perf_counter() + host_seconds
            while time.perf_counter() < busy_until:
                pass
        for micro in range(accumulate):
            use_branch = (branch == "rank1" and rank == 1) or (branch == "from_step5" and step >= 5)
            inputs = next(batches) if batches else torch.randn(4, 6, generator=generator)
            if micro < accumulate - 1:
                with model.no_sync():
                    (model(inputs, use_branch=use_branch) if branch else model(inputs)).pow(2).mean().backward()
            else:
                (model(inputs, use_branch=use_branch) if branch else model(inputs)).pow(2).mean().backward()
        if os.environ.get("CLIP"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        optimizer.step()
        optimizer.zero_grad()
        if step == 0 and os.environ.get("FAIL_RANK") == str(rank):
            raise RuntimeError(f"rank {rank} failed on purpose")
    runtime = sys.modules.get("autogaudi.entry.runtime")
    result = json.dumps(
        {
            "rank": rank,
            "checksum": [round(float(p.detach().double().sum()), 6) for p in model.parameters()],
            "digest": hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest(),
            "autogaudi": runtime.is_enabled() if runtime else False,
            "sources": runtime._STATE.sources if runtime else [],
            "bucket_view": model.gradient_as_bucket_view,
            "units": {row["name"]: row for row in runtime.report().as_dict()["units"]} if runtime else {},
        }
    )
    with open(os.path.join(os.environ["RESULTS"], f"rank{rank}.json"), "w") as handle:
        handle.write(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
