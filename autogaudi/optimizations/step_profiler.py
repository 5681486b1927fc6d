"""Where a training step's time goes — host, device or input — measured on a sampled window.

Why: the Gaudi guide's first rule is to profile the host: when the device waits for the host to
issue work (host-bound), graph capture removes that wait; when the device is the bottleneck it buys
nothing and costs compile time. Users profile by hand; autogaudi measures it on every run, cheaply:

1. Window: ``WINDOW`` steps right after warm-up, timed boundary to boundary (optimizer steps), with
   the time spent waiting for DataLoader batches. Nothing is added to these steps.
2. Census: the next step runs under a ``TorchDispatchMode`` that counts the ops the step issues
   (every aten op: forward, backward and optimizer), adds up the time they compute, and records
   which top-level module produced the step (for graph capture). On CUDA torch.profiler's CUDA
   activity (CUPTI) gives the device time of the step's kernels, idle gaps excluded; on the CPU
   the clock around each kernel does the same. On HPU (lazy: ops are not run one by one)
   the step ends with ``mark_step`` + ``synchronize`` and the wait is the device time the host did
   not hide. The census step itself is slower (it is observed); only counts and compute time come
   from it, set against the clean window's step time.

Classification (thresholds stated in docs/units/step_profiler.md): input-bound when waiting for
data is at least half of a step; else host-bound when ops compute less than half of a step (the
rest is Python, dispatch and launch overhead: what graph capture removes); otherwise device-bound.
Other units (graph_capture) subscribe with :meth:`StepProfiler.when_profiled`. On a distributed run
each rank measures its own steps and all follow rank 0's classification (a broadcast at the census
step), so every rank starts the same trials at the same step: ranks that decided apart would wait in
different collectives.
"""
from __future__ import annotations

import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autogaudi.ranks import rank_zero_choice
from autogaudi.trials import Trial
from autogaudi.unit import Unit

WINDOW = 5
INPUT_BOUND = 0.5
HOST_BOUND = 0.5


def classify(step_s: float, input_wait_s: float, device_busy_s: float) -> tuple:
    """(``"input"`` / ``"host"`` / ``"device"``, why) for a step's time split."""
    waiting = input_wait_s / step_s
    if waiting >= INPUT_BOUND:
        return "input", f"waiting for data {waiting:.0%} of each step"
    busy = device_busy_s / step_s
    if busy < HOST_BOUND:
        return "host", f"ops compute {busy:.0%} of each step; issuing them (Python, dispatch) takes the rest"
    # The census step runs slower than the window's steps, so its compute time can exceed them.
    return "device", f"ops compute {'all' if busy >= 1 else f'{busy:.0%}'} of each step"


class _Census(TorchDispatchMode):
    """Counts the ops of one step and, on the CPU, adds up the time their kernels compute (the
    clock around each kernel, less what the clock and the call cost for a trivial op); the Python
    and dispatch overhead between ops is what it leaves out."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.cpu_seconds = 0.0
        self.overhead = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        start = time.perf_counter()
        result = func(*args, **(kwargs or {}))
        self.cpu_seconds += time.perf_counter() - start
        return result

    def calibrate(self, repeats: int = 200) -> None:
        a, b = torch.ones(1), torch.ones(1)
        for _ in range(repeats):
            torch.add(a, b)
        self.overhead = self.cpu_seconds / repeats
        self.ops, self.cpu_seconds = 0, 0.0

    def busy_seconds(self) -> float:
        return max(0.0, self.cpu_seconds - self.ops * self.overhead)


class _KernelTimes:
    """CUDA: the device time of the step's kernels, from torch.profiler's CUDA activity (CUPTI).
    Event pairs around each op were tried first and measured the host's launch latency too
    (170% of a host-bound step on an H100), since an idle device stamps the start event at once."""

    def __init__(self):
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self.profiler.__enter__()

    def stop(self) -> float:
        torch.cuda.synchronize()
        with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": not the user's
            warnings.simplefilter("ignore")
            self.profiler.__exit__(None, None, None)
        return sum(event.time_range.elapsed_us() for event in self.profiler.events()
                   if event.device_type == torch.autograd.DeviceType.CUDA) / 1e6


class _RootModules:
    """The outermost modules called during the census step (what produced the loss)."""

    def __init__(self):
        self.depth = 0
        self.called: list = []
        self.handles = [torch.nn.modules.module.register_module_forward_pre_hook(self._enter),
                        torch.nn.modules.module.register_module_forward_hook(self._leave)]

    def _enter(self, module, _args):
        if self.depth == 0 and not any(module is seen for seen in self.called):
            self.called.append(module)
        self.depth += 1

    def _leave(self, _module, _args, _output):
        self.depth = max(0, self.depth - 1)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def training_model(roots: list, optimizer):
    """The root module that owns most of the optimizer's parameters (DDP unwrapped), or None."""
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    best, best_count = None, 0
    for module in roots:
        count = sum(p.numel() for p in module.parameters() if id(p) in optimized)
        if count > best_count:
            best, best_count = module, count
    if isinstance(best, torch.nn.parallel.DistributedDataParallel):
        best = best.module  # graphs go inside DDP: its hooks must stay outside the captured graph
    return best


class StepProfile:
    """The result: the bound, why, the figures, and the module that produced the step's loss."""

    def __init__(self, bound: str, why: str, figures: dict, model, optimizer):
        self.bound = bound
        self.why = why
        self.figures = figures
        self.model = model
        self.optimizer = optimizer  # the optimizer whose step ended the census step


class StepProfiler(Unit):
    targets = ("torch.optim.Optimizer step post hook (session)", "DataLoader batch fetch (session)",
               "global module forward hooks and a TorchDispatchMode, for one census step")

    def apply(self) -> None:
        self.profile = None
        self._subscribers: list = []
        self._window_start = None
        self._waited = 0.0
        self._census = None
        self._kernels = None
        self._kernels_seconds = None
        self._roots = None
        steps = self.session.steps
        steps.after_optimizer_step(self, self._after_step)
        steps.after_batch(self, self._after_batch)
        self.on_revert(self._stop_census)
        self.reason = f"waiting for {self.options.warmup_steps} warm-up steps"

    def when_profiled(self, unit, callback) -> None:
        """``callback(profile)`` once the step is classified (at once if it already is)."""
        if self.profile is not None:
            with unit.fail_open():
                callback(self.profile)
        else:
            self._subscribers.append((unit, callback))

    def _after_batch(self, _iterator, _batch, waited: float) -> None:
        if self._window_start is not None:
            self._waited += waited

    def _after_step(self, optimizer) -> None:
        done = self.session.steps.optimizer_steps - self.options.warmup_steps
        if done == 0:
            self._window_start, self._waited = time.perf_counter(), 0.0
        elif done == WINDOW:
            self._window = (time.perf_counter() - self._window_start) / WINDOW, self._waited / WINDOW
            self._window_start = None
            self._start_census()
        elif done == WINDOW + 1:
            self._finish_census(optimizer)

    def _start_census(self) -> None:
        self._roots = _RootModules()
        if self.backend.name == "hpu":
            self.backend.synchronize()
        self._kernels = _KernelTimes() if self.backend.name == "cuda" else None
        self._census = _Census()
        self._census.__enter__()
        self._census.calibrate()

    def _stop_census(self) -> None:
        if self._census is not None:
            self._census.__exit__(None, None, None)
        if self._kernels is not None:
            self._kernels_seconds = self._kernels.stop()
            self._kernels = None
        if self._roots is not None:
            self._roots.remove()

    def _finish_census(self, optimizer) -> None:
        self._stop_census()
        census, roots = self._census, self._roots.called
        self._census = self._roots = None
        step_s, waited_s = self._window
        figures = {"ms_per_step": round(1000 * step_s, 3), "input_wait_fraction": round(waited_s / step_s, 3),
                   "ops_per_step": census.ops}
        if self.backend.name == "hpu":
            self.backend.mark_step()
            issued = time.perf_counter()
            self.backend.synchronize()
            busy_s = time.perf_counter() - issued
        elif self.backend.name == "cuda":
            busy_s = self._kernels_seconds
        else:
            busy_s = census.busy_seconds()
        figures["compute_fraction"] = round(min(busy_s / step_s, 1.0), 3)
        measured = classify(step_s, waited_s, busy_s)
        bound, why = rank_zero_choice(measured)
        if bound != measured[0]:
            self.note(f"this rank measured {measured[0]}-bound ({measured[1]}); every rank follows rank 0")
        model = training_model(roots, optimizer)
        self.profile = StepProfile(bound, why, figures, model, optimizer)
        self.figures.update(bound=bound, **figures)
        self.reason = f"{bound}-bound: {why}"
        if model is not None:
            self.figures["model"] = type(model).__name__
        self.session.steps.forget(self)  # classified once: no more work on every step and batch
        subscribers, self._subscribers = self._subscribers, []
        for unit, callback in subscribers:
            if unit not in self.session.applied:
                continue  # reverted (failed, or disable()) since it subscribed
            with unit.fail_open():
                callback(self.profile)


class ActsOnProfile(Unit):
    """Base of the units that act once the step is profiled: they need the training model it finds."""

    def skip_reason(self):
        profiler = self.session.unit("step_profiler")
        if profiler is None or profiler not in self.session.applied:
            return "needs the step_profiler unit (it finds the training model), which is not on"
        return super().skip_reason()

    def when_profiled(self, callback) -> None:
        self.session.unit("step_profiler").when_profiled(self, callback)

    def switch_on_or_try(self, switch, decided) -> bool:
        """Switch on at once when ``--force``d or with ``--no-trials`` (returns True); otherwise hand
        ``switch`` to a trial, whose outcome goes to ``decided(keep, record)`` (returns False)."""
        if self.name in self.options.force or self.options.no_trials:
            switch(True)
            return True
        self.session.trials.submit(Trial(self, self.name, switch, decided))
        return False
