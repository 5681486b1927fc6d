"""The CUDA backend: torch's own fused kernels and CUDA graphs (via torch.compile)."""

from __future__ import annotations

import sys

import torch

from autogaudi.backends.base import Backend, MemoryStats, compile_calls, compile_workers_running


class CudaBackend(Backend):
    name = "cuda"
    device_type = "cuda"
    pin_memory_device = "cuda"
    least_capture_one_off_s = 3.0
    capture_one_off_rate_s = 0.8  # minGPT's GPT on an H200: 22-24 s for about 1000 ops per step (0.7-0.75)
    host_runs_ahead = True
    # CUPTI's start, at the census's first kernel timing: 4.2-4.9 s on an H100 (docs/units/step_profiler.md).
    census_one_off_s = 4.5
    # The replay tier's one-off, measured on an H100 (docs/units/graph_capture.md): 3.8-5.3 s for 30-82
    # ops per step (importing and tracing are most of it), 6.0-7.7 s for minGPT's 628-1013, against
    # inductor's 20 s for a 4-layer GPT.
    replay_one_off_rate_s = 0.24
    least_replay_one_off_s = 3.5
    # By region, a host-bound GPT's steps ran slower than eager on an H100 (13.4 ms against 7.2; whole
    # 4.3, replay 3.7): each block is its own compiled call, with its guards and launches. Not offered;
    # benchmarks/one_offs.py switches it on to measure it again.
    graphs_by_region = False

    def device_name(self) -> str:
        return torch.cuda.get_device_name()

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def fast_bf16(self) -> bool:
        return torch.cuda.get_device_capability() >= (8, 0)  # bf16 tensor cores from Ampere on

    def memory_stats(self):
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return MemoryStats(torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(), total)

    def limit_memory(self, size: int):
        """The caching allocator refuses to hold more than ``size`` bytes: an allocation past it raises
        torch's out-of-memory error, as on a device that small. The fraction the script set (or 1.0)
        comes back on undo."""
        device = torch.cuda.current_device()
        total = torch.cuda.get_device_properties(device).total_memory
        before = torch.cuda.get_per_process_memory_fraction(device)
        torch.cuda.set_per_process_memory_fraction(min(1.0, size / total), device)
        return lambda: torch.cuda.set_per_process_memory_fraction(before, device)

    def graph_forward(self, module, exact_random: bool = False, static_outputs: bool = True):
        # "reduce-overhead" is torch.compile's CUDA-graphs mode: replay instead of re-launching. A
        # mode and options cannot be passed together; the mode stands for inductor's triton.cudagraphs.
        # Without static outputs (a module called again while its last outputs are in use), plain
        # inductor kernels: fewer launches, and no replay writing over live outputs.
        self._trees_were_started = "torch._inductor.cudagraph_trees" in sys.modules
        self._workers_were_running = compile_workers_running()
        options = {"triton.cudagraphs": static_outputs, "fallback_random": exact_random}
        self._graph_kind = "CUDA graphs" if static_outputs else "torch.compile without CUDA graphs"
        if static_outputs and not exact_random:
            return compile_calls(module, mode="reduce-overhead")
        return compile_calls(module, options=options)

    def graph_blocks(self, exact_random: bool = False):
        self._trees_were_started = "torch._inductor.cudagraph_trees" in sys.modules
        self._graph_kind = "torch.compile by region, without CUDA graphs"
        return super().graph_blocks(exact_random)

    def graph_replay(self, module):
        # torch.compile's "cudagraphs" backend: AOTAutograd's forward and backward recorded by cudagraph
        # trees (the liveness checks "reduce-overhead" has), torch's own kernels replayed, none generated.
        # Static shapes: that backend records one graph per shape and cannot replay a graph made
        # dynamic (a smaller last batch raised a size mismatch on an H100); a new shape records anew.
        self._trees_were_started = "torch._inductor.cudagraph_trees" in sys.modules
        self._workers_were_running = compile_workers_running()
        self._graph_kind = "CUDA graphs of torch's own kernels (torch.compile's cudagraphs backend, no inductor)"
        return compile_calls(module, backend="cudagraphs", dynamic=False)

    def graph_kind(self) -> str:
        return self._graph_kind

    def release_graphs(self, graphed) -> None:
        super().release_graphs(graphed)
        if not self._trees_were_started:  # only autogaudi's: the trees (and their memory pool) go
            trees = sys.modules.get("torch._inductor.cudagraph_trees")
            if trees is not None:
                trees.reset_cudagraph_trees()


def probe():
    """The CudaBackend, where torch sees a CUDA device (asked by :func:`autogaudi.backends.select`)."""
    return CudaBackend(f"{torch.cuda.device_count()} CUDA device(s), torch CUDA {torch.version.cuda}")
