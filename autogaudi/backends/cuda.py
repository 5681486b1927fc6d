"""The CUDA backend: torch's own fused kernels and CUDA graphs (via torch.compile)."""
from __future__ import annotations

import torch

from autogaudi.backends.base import Backend, MemoryStats


class CudaBackend(Backend):
    name = "cuda"
    device_type = "cuda"
    pin_memory_device = "cuda"

    def device_name(self) -> str:
        return torch.cuda.get_device_name()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def memory_stats(self):
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return MemoryStats(torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), total)

    def graph_forward(self, module, exact_random: bool = False):
        # "reduce-overhead" is torch.compile's CUDA-graphs mode: replay instead of re-launching. A
        # mode and options cannot be passed together; the mode stands for inductor's triton.cudagraphs.
        if exact_random:
            return torch.compile(module.forward, options={"triton.cudagraphs": True, "fallback_random": True})
        return torch.compile(module.forward, mode="reduce-overhead")


def probe():
    """A CudaBackend if a CUDA device is usable, else the reason it is not."""
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    return CudaBackend(f"{torch.cuda.device_count()} CUDA device(s), torch CUDA {torch.version.cuda}")
