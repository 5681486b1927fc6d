"""The Intel Gaudi backend, written against the documented ``habana_frameworks.torch`` API.

No Gaudi was available while this was written: it follows ``shared/docs/hpu-api.md`` and is
exercised against the API-faithful test double in ``tests/hpu_double``. Everything keys off
``is_lazy()``: lazy mode (``PT_HPU_LAZY_MODE=1``, the default up to Gaudi software 1.19) queues ops
until ``mark_step()`` and captures graphs with ``ModuleCacher``; eager mode (the default since)
has no step marks and compiles with ``torch.compile(backend="hpu_backend")``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import sys

import torch

from autogaudi.backends.base import NO_BRIDGE, Backend, MemoryStats, _call_block, compile_calls
from autogaudi.backends.hpu_signals import HpuSignals

# torch.optim arguments the Gaudi fused optimizers do not have, with the value that means "unused".
_UNSUPPORTED_UNLESS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
}
_FUSED_ARGUMENTS = {
    "FusedAdamW": ("lr", "betas", "eps", "weight_decay"),
    "FusedSGD": ("lr", "momentum", "weight_decay", "dampening", "nesterov"),
}


def _fused_name(name: str, hyperparameters: dict):
    if name in ("Adam", "AdamW"):
        # FusedAdamW decays weights the AdamW way; Adam's L2 decay is the same only at zero.
        decoupled = name == "AdamW" or hyperparameters.get("decoupled_weight_decay", False)
        return "FusedAdamW" if decoupled or hyperparameters.get("weight_decay", 0) == 0 else None
    return {"SGD": "FusedSGD"}.get(name)


def fused_optimizer_refusal(name: str, hyperparameters: dict):
    """Why torch.optim's ``name`` with these hyperparameters has no hpex fused optimizer to run as,
    or None where it has one (the fused_optimizer unit and the doctor ask)."""
    fused_name = _fused_name(name, hyperparameters)
    if fused_name is None:
        detail = " with L2 weight decay (it decays like AdamW)" if name == "Adam" else ""
        return f"no Gaudi fused optimizer for {name}{detail}"
    unsupported = [
        f"{argument}={hyperparameters[argument]!r}"
        for argument, unused in _UNSUPPORTED_UNLESS.items()
        if hyperparameters.get(argument, unused) != unused
    ]
    if unsupported:
        return f"{fused_name} has no {', '.join(unsupported)}"
    return None


def graph_blocker(module):
    """(code, params) of what keeps ModuleCacher from capturing ``module``, or None. ModuleCacher
    (bridge 1.19, hpu/graphs.py) calls the model by keyword, so it asserts on a forward with *args
    or positional-only parameters; a replay runs the recorded graph, not Python, so module hooks (an
    activation logger, a pruning mask) would silently stop."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL)
    if any(p.kind in kinds for p in inspect.signature(module.forward).parameters.values()):
        return "positional_forward", {"model": type(module).__name__}
    hooked = [
        type(sub).__name__
        for sub in module.modules()
        if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks
    ]
    if hooked or _global_module_hooks():
        return "module_hooks", {"where": ", ".join(sorted(set(hooked))) or "all modules (global hooks)"}
    return None


def _cached_or_plain(module, cached, plain, *args, **kwargs):
    """ModuleCacher's cached forward, with the module's ``orig_forward`` put back for the call only:
    past ``max_graphs`` (a new input key: shapes, a Python value, the autocast state) the cacher runs
    the call uncached through it, the plain forward, instead of raising for want of it."""
    had = vars(module).get("orig_forward", _MISSING)
    vars(module)["orig_forward"] = plain
    try:
        return cached(*args, **kwargs)
    finally:
        if had is _MISSING:
            vars(module).pop("orig_forward", None)
        else:
            vars(module)["orig_forward"] = had


_MISSING = object()


def _global_module_hooks() -> bool:
    module = torch.nn.modules.module
    return bool(
        module._global_forward_hooks
        or module._global_forward_pre_hooks
        or module._global_backward_hooks
        or module._global_backward_pre_hooks
    )


class HpuBackend(Backend):
    name = "hpu"
    device_type = "hpu"
    pin_memory_device = "hpu"
    graphs_can_draw_eager_random = False  # an inductor setting; the Gaudi graph compilers have none
    least_capture_one_off_s = 1.0  # never measured (no Gaudi): the earlier, conservative floor
    capture_one_off_rate_s = 0.8  # never measured: the other backends' prior
    host_runs_ahead = True

    def __init__(self, reason: str, core, hpu, lazy: bool):
        super().__init__(reason)
        self._core = core
        self._hpu = hpu
        self.is_lazy = lazy
        self.signals = None  # HpuSignals while a session watches this backend

    def describe(self) -> dict:
        described = super().describe()
        if self.signals is not None:
            described["signals"] = self.signals.as_dict()
        return described

    def watch_signals(self, session):
        # The bridge's own counts (hpu-api.md, Metrics and diagnostics): fallbacks and compilations.
        self.signals = HpuSignals(importlib.import_module("habana_frameworks.torch.hpu.metrics"), session)
        return self.signals.stop

    def compiling_for_autogaudi(self) -> None:
        if self.signals is not None:
            self.signals.compiling_for_autogaudi()

    def fast_bf16(self) -> bool:
        return True  # the MME's native type (Gaudi performance guide: bf16 autocast)

    @property
    def graphs_by_region(self) -> bool:
        # Lazy: ModuleCacher caches a module's graphs per instance. Eager: torch.compile with
        # hpu_backend, each repeated block class compiled once (regional compilation).
        return not self.is_lazy

    @property
    def graphs_hold_gradients(self) -> bool:
        return self.is_lazy  # ModuleCacher; eager mode compiles with torch.compile instead

    def device_name(self) -> str:
        return self._hpu.get_device_name()

    def mark_step(self) -> None:
        if self.is_lazy:
            self._core.mark_step()

    def synchronize(self) -> None:
        self._hpu.synchronize()

    def memory_stats(self):
        stats = self._hpu.memory_stats()
        return MemoryStats(stats["InUse"], stats["MaxInUse"], stats["Limit"])

    @property
    def graphs_replay_recorded_branches(self) -> bool:
        return self.is_lazy  # ModuleCacher; eager mode's torch.compile guards on the branch

    @property
    def graphs_can_keep_outputs(self) -> bool:
        return not self.is_lazy  # ModuleCacher replays into the same output tensors

    def graph_refusal(self, module):
        if not self.is_lazy:
            return None
        return graph_blocker(module) or self._fallback_refusal()

    def _fallback_refusal(self):
        """An HPU graph capture asserts on an op that falls back to the CPU (the bridge's graphs hold
        device ops only): where the bridge has counted any fallback in this process, capture is
        refused first, naming the ops."""
        metrics = importlib.import_module("habana_frameworks.torch.hpu.metrics")
        ops = dict(metrics.metric_global("cpu_fallback").stats()).get("FallbackOps") or {}
        if ops:
            return "cpu_fallback_ops", {"ops": ", ".join(sorted(ops))}
        return None

    def graph_forward(self, module, exact_random: bool = False, static_outputs: bool = True, max_graphs: int = 10):
        if self.is_lazy:
            # The Gaudi guide's training API. It works in place: it sets module.forward and leaves
            # more attributes (orig_forward, capture_start, ...; bound to the cacher, which a
            # torch.save of the model would then pickle). All of them are taken back off, so the
            # module is left as it was; the graph_capture unit routes training calls to the cached
            # forward (never the cacher's uncached path, which reads orig_forward).
            before = dict(vars(module))
            self._hpu.ModuleCacher(max_graphs=max_graphs)(model=module, inplace=True)
            cached, plain = vars(module)["forward"], vars(module)["orig_forward"]
            for name in set(vars(module)) - set(before):
                del vars(module)[name]
            vars(module).update(before)
            return functools.partial(_cached_or_plain, module, cached, plain)
        return compile_calls(module, backend="hpu_backend")

    def graph_blocks(self, exact_random: bool = False):
        """Eager mode's regional compilation: each block class compiled once with ``hpu_backend``
        (the Gaudi guide's training recommendation), not inductor."""
        return torch.compile(_call_block, backend="hpu_backend")

    def graph_kind(self) -> str:
        return "HPU graphs, ModuleCacher" if self.is_lazy else "torch.compile, hpu_backend"

    def release_graphs(self, graphed) -> None:
        if not self.is_lazy:
            super().release_graphs(graphed)

    def compile_cache_counts(self):
        # Graphs compile to recipes in the bridge, whose disk cache (PT_HPU_RECIPE_CACHE_CONFIG) keeps
        # no count a process can read without PT_HPU_ENABLE_CACHE_METRICS: not claimed either way.
        return None

    def save_compile_artifacts(self):
        return None  # the bridge's recipe cache keeps what its graphs compile to

    def load_compile_artifacts(self, data: bytes) -> bool:
        return False

    def fused_optimizer_refusal(self, optimizer_class, hyperparameters: dict):
        return fused_optimizer_refusal(optimizer_class.__name__, hyperparameters)

    def fused_optimizer(self, optimizer_class, params, hyperparameters: dict):
        if self.fused_optimizer_refusal(optimizer_class, hyperparameters):
            return None
        fused_name = _fused_name(optimizer_class.__name__, hyperparameters)
        optimizers = importlib.import_module("habana_frameworks.torch.hpex.optimizers")
        # Every value is passed explicitly: FusedAdamW's own defaults (eps 1e-6, weight_decay 0.0)
        # differ from torch.optim.AdamW's, and the user's run must not change because of that.
        supported = {key: hyperparameters[key] for key in _FUSED_ARGUMENTS[fused_name] if key in hyperparameters}
        return getattr(optimizers, fused_name)(params, **supported)

    def fused_clip_norm(self, parameters, max_norm: float):
        normalization = importlib.import_module("habana_frameworks.torch.hpex.normalization")
        return normalization.FusedClipNorm(parameters, max_norm).clip_norm

    def fused_sdpa(self):
        return importlib.import_module("habana_frameworks.torch.hpex.kernels").FusedSDPA


def probe():
    """An HpuBackend if the Gaudi bridge is installed and sees a device, else the reason not."""
    if importlib.util.find_spec("habana_frameworks") is None:
        return NO_BRIDGE
    core = importlib.import_module("habana_frameworks.torch.core")  # registers torch.hpu
    hpu = importlib.import_module("habana_frameworks.torch.hpu")
    if not hpu.is_available():
        return "habana_frameworks.torch is installed but hpu.is_available() is False"
    lazy = bool(core.is_lazy())
    reason = f"{hpu.device_count()} Gaudi device(s), {'lazy' if lazy else 'eager'} mode"
    if os.environ.get("PT_HPU_GPU_MIGRATION") == "1" or "habana_frameworks.torch.gpu_migration" in sys.modules:
        reason += "; GPU migration layer active (torch.cuda calls run on HPU)"
    return HpuBackend(reason, core, hpu, lazy)
