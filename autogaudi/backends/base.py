"""What a backend offers the optimization units, and the torch-native defaults CUDA and CPU share."""

from __future__ import annotations

import sys
import time

import torch

GB = 1024**3
# The HPU probe's answer where the Gaudi bridge is not installed.
NO_BRIDGE = "habana_frameworks.torch is not installed (it comes with Intel's Gaudi software)"


class MemoryStats:
    """Bytes: in use now, peak in use, and the total the device (or machine) offers."""

    __slots__ = ("allocated", "max_allocated", "total")

    def __init__(self, allocated: int, max_allocated: int, total: int):
        self.allocated = allocated
        self.max_allocated = max_allocated
        self.total = total

    def as_dict(self) -> dict:
        return {
            "memory_allocated_gb": round(self.allocated / GB, 3),
            "max_memory_allocated_gb": round(self.max_allocated / GB, 3),
            "total_memory_available_gb": round(self.total / GB, 3),
        }

    def format(self) -> str:
        return f"mem {self.allocated / GB:.2f} GB (peak {self.max_allocated / GB:.2f} GB of {self.total / GB:.1f} GB)"


class Backend:
    """The primitives units build on. ``reason`` says why this backend was chosen."""

    name = ""
    device_type = ""
    is_lazy = False
    pin_memory_device = None  # None: pinning memory does nothing for this backend
    # Captured graphs write gradients into fixed tensors and cannot replay checkpointed regions
    # (HPU lazy ModuleCacher): zero_grad must keep the tensors, gradient checkpointing rules graphs out.
    graphs_hold_gradients = False
    # Whether graph_forward(exact_random=True) can make random ops draw eager's numbers.
    graphs_can_draw_eager_random = True
    # The smallest one-off cost (compile, capture) a capture trial was measured to add on this backend,
    # in seconds: a run that cannot save this much cannot pay back a real one (docs/units/graph_capture.md).
    least_capture_one_off_s = 2.0
    # The prior of this model's one-off (autogaudi.measure.one_offs): seconds per sqrt(ops per step), before
    # any one-off is measured on this machine; on the high side of the 2-core CPU's (0.6, spread 1.35x),
    # since expecting too little is what makes a short run pay.
    capture_one_off_rate_s = 0.8
    # Whether graph_forward(static_outputs=False) can capture a module whose outputs outlive the next
    # call (called several times per step): False where every replay writes into the same tensors.
    graphs_can_keep_outputs = True
    # Whether graph_forward's graphs replay the ops they recorded without Python (HPU lazy ModuleCacher):
    # a branch the forward takes on a device value is then replayed as it went at capture. torch.compile
    # breaks the graph there and guards on it instead.
    graphs_replay_recorded_branches = False
    # What the step profiler's device timing costs the first time a process uses it, in seconds (None:
    # nothing measurable): the census waits until the run is long enough to carry it.
    census_one_off_s = None
    # Whether the host queues work ahead of the device, so that reading a device value (``.item()``)
    # stalls it until the device has drained (CUDA streams, Gaudi's lazy and eager queues).
    host_runs_ahead = False
    # torch.optim classes with a fused kernel on this backend (torch >= 2.4 for CPU).
    FUSED_TORCH_OPTIMIZERS = ("Adam", "AdamW", "SGD")
    # Whether graph_blocks can compile one block class for all its instances (regional compilation).
    graphs_by_region = True
    # inductor options for graph_blocks' compile (torch.compile's ``options``: scoped to that compile).
    region_compile_options: dict = {}
    # The replay tier (autogaudi.measure.one_offs): graph_replay's one-off prior, seconds per sqrt(ops per step),
    # and the least it can cost; None where the backend has no such tier.
    replay_one_off_rate_s = None
    least_replay_one_off_s = None
    # Whether compile workers were up before graph_forward compiled (then none of them are ours).
    _workers_were_running = True

    def __init__(self, reason: str):
        self.reason = reason

    def device_name(self) -> str:
        raise NotImplementedError

    def device_key(self) -> str:
        """What names the device in the cache's keys (remembered decisions, compile times): its name,
        unless naming it costs a run what the key does not need."""
        return self.device_name()

    def watch_signals(self, session):
        """Start reading the device's own run-time counts for the report (the Gaudi bridge's metrics);
        the undo, or None where the backend has none."""
        return None

    def mark_step(self) -> None:
        """Flush queued work (HPU lazy mode); nothing to do on eager backends."""

    def compiling_for_autogaudi(self) -> None:
        """autogaudi's own capture compiles in the step under way: the device's signals must not count
        what it compiles as the script's recompiles. Nothing to do where no signals are read."""

    def synchronize(self) -> None:
        """Wait until the device has finished the work issued so far."""

    def memory_stats(self):
        """A :class:`MemoryStats`, or None where the backend cannot tell."""
        return None

    def limit_memory(self, size: int):
        """Hold this process to ``size`` bytes of device memory (``--memory-limit``): the undo, or None
        where the backend cannot enforce it and the limit is only the budget decisions plan with."""
        return None

    def fast_bf16(self) -> bool:
        """Whether bf16 autocast runs matrix products faster than float32 here (tensor cores, Gaudi's
        MME); not the CPU's default: on the 2-core machine here it ran 0.10-0.33x."""
        return False

    def graph_forward(self, module, exact_random: bool = False, static_outputs: bool = True):
        """A callable taking ``module(...)``'s arguments that replays captured graphs (cutting
        per-step host overhead), hooks included; ``module`` itself is left as it was.
        ``exact_random``: random ops (dropout) draw eager's numbers (inductor's ``fallback_random``),
        at a cost in speed. ``static_outputs=False``: outputs must survive the next call."""
        self._workers_were_running = compile_workers_running()
        return compile_calls(module, options={"fallback_random": True} if exact_random else None)

    def graph_blocks(self, exact_random: bool = False):
        """Regional compilation: a callable ``(block, *args, **kwargs)`` that runs ``block`` (hooks and
        ``forward``) compiled, one compiled code for every instance of a block class: Dynamo guards
        on the class and treats the parameters as inputs (``inline_inbuilt_nn_modules``), so the
        repeats of a GPT's layers compile once. No CUDA graphs: the blocks' replays would write into
        each other's inputs."""
        self._workers_were_running = compile_workers_running()
        options = {**self.region_compile_options, **({"fallback_random": True} if exact_random else {})}
        return torch.compile(_call_block, options=options or None)

    def graph_replay(self, module):
        """The replay tier, where ``replay_one_off_rate_s`` is set: like :meth:`graph_forward`, but the
        forward and backward are recorded as device graphs and replayed without a compiler generating
        kernels, so its one-off is a trace's, not a compile's (and no kernels are fused)."""
        raise NotImplementedError(f"{self.name} has no replay tier")

    def graph_refusal(self, module):
        """Why ``graph_forward`` cannot capture ``module`` faithfully here, or None: (a reason code of
        graph_capture's table, the values its text is filled in with)."""
        return None

    def graph_kind(self) -> str:
        """What ``graph_forward`` captures with here, for the report."""
        return "torch.compile"

    def release_graphs(self, graphed) -> None:
        """Drop what ``graph_forward`` built: compiled code, its guards (which hold the module) and
        graphs. Only autogaudi's own cache entries go: they sit on a function of its own."""
        release_compiled_calls()
        self.stop_compile_workers()

    def compile_cache_counts(self):
        """{"hits": n, "misses": n} of torch.compile's FX-graph and AOTAutograd caches so far in this
        process (a graph compiled from the cache is a hit in both), or None where no such count exists."""
        dynamo_utils = sys.modules.get("torch._dynamo.utils")
        if dynamo_utils is None:
            return {"hits": 0, "misses": 0}
        counters = dynamo_utils.counters
        hits = counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
        misses = counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"]
        return {"hits": hits, "misses": misses}

    def save_compile_artifacts(self):
        """What torch.compile has compiled in this process, as one blob to load in a later one
        (``torch.compiler.save_cache_artifacts``: its FX-graph, AOTAutograd and kernel caches' entries),
        or None where there is nothing."""
        saved = torch.compiler.save_cache_artifacts()
        return saved[0] if saved else None

    def load_compile_artifacts(self, data: bytes) -> bool:
        """Put a blob of :meth:`save_compile_artifacts` into torch.compile's caches; whether it held any."""
        return torch.compiler.load_cache_artifacts(data) is not None

    def stop_compile_workers(self):
        """Shut down the compiler's worker processes if autogaudi's ``graph_forward`` started them
        (never the script's own): seconds it took, or None where there was nothing of ours to stop."""
        if self._workers_were_running or not compile_workers_running():
            return None
        started = time.perf_counter()
        sys.modules["torch._inductor.async_compile"].shutdown_compile_workers()
        return time.perf_counter() - started

    def fused_optimizer_refusal(self, optimizer_class, hyperparameters: dict):
        """Why ``optimizer_class(**hyperparameters)`` has no fused equivalent here, or None."""
        if optimizer_class.__name__ not in self.FUSED_TORCH_OPTIMIZERS:
            return f"torch has no fused {optimizer_class.__name__}"
        for argument in ("foreach", "differentiable"):
            if hyperparameters.get(argument):
                return f"{argument}=True cannot be combined with fused=True"
        return None

    def fused_optimizer(self, optimizer_class, params, hyperparameters: dict):
        """A separate fused optimizer object for ``params``, or None where torch's own ``fused=True``
        is the fused path (CUDA, CPU): then the user's optimizer is simply built with it."""
        return None

    def fused_clip_norm(self, parameters, max_norm: float):
        """A reusable ``clip(parameters) -> total_norm`` for L2 clipping, or None (use torch's)."""
        return None

    def fused_sdpa(self):
        """A fused scaled-dot-product attention with FusedSDPA's signature, or None."""
        return None

    def describe(self) -> dict:
        return {"name": self.name, "device": self.device_name(), "lazy": self.is_lazy, "reason": self.reason}


def _caller(module):
    def call_module(*args, **kwargs):
        return module._call_impl(*args, **kwargs)

    return call_module


def compile_calls(module, **compile_options):
    """``torch.compile`` of calling ``module`` (hooks and ``forward``, as ``Module.compile()`` does),
    through a function of autogaudi's own, so that its cache entries can be dropped alone."""
    return torch.compile(_caller(module), **compile_options)


def compile_workers_running() -> bool:
    """Whether inductor's compile-worker pools are up (started by the first compile that wants them;
    they are shut down at exit, which a run pays for)."""
    async_compile = sys.modules.get("torch._inductor.async_compile")
    return bool(getattr(async_compile, "_pool_set", None))


def _call_block(block, *args, **kwargs):
    return block._call_impl(*args, **kwargs)


def release_compiled_calls() -> None:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None:
        eval_frame.reset_code(_caller(None).__code__)
        eval_frame.reset_code(_call_block.__code__)
