"""Ten DDP steps on gloo with rank-specific data; each rank writes its parameters' checksum and
whether autogaudi is on in it, as JSON, to $RESULTS/rank<N>.json (a file each: ranks share stdout and
their lines can interleave). FAIL_RANK=N makes rank N raise after its first step."""
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(rank)
    for step in range(10):
        loss = model(torch.randn(4, 6, generator=generator)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 0 and os.environ.get("FAIL_RANK") == str(rank):
            raise RuntimeError(f"rank {rank} failed on purpose")
    runtime = sys.modules.get("autogaudi.runtime")
    result = json.dumps({
        "rank": rank,
        "checksum": [round(float(p.double().sum()), 6) for p in model.parameters()],
        "autogaudi": runtime.is_enabled() if runtime else False,
        "sources": runtime._STATE.sources if runtime else [],
        "bucket_view": model.gradient_as_bucket_view,
    })
    with open(os.path.join(os.environ["RESULTS"], f"rank{rank}.json"), "w") as handle:
        handle.write(result)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
