"""The anatomy of a training step's memory: predicted on fake tensors, then measured on a real step.

Why: the exit report's peak figure alone gives nothing to act on; what a step holds at its peak —
parameters, gradients, optimizer state, activations, temporaries — says what would bring it down
(checkpointing frees activations, a smaller optimizer state its share). Both figures come from
torch's own tracker, ``torch.distributed._tools.mem_tracker.MemTracker`` (a dispatch mode that
files every tensor a step creates under one of those parts):

* *predicted*, before the training model's first forward: a fake copy of the model, its
  optimizer and the batch runs two steps under ``FakeTensorMode`` (the second one tracked, when the
  optimizer state exists), so no device memory is touched and no random draw of the run is taken;
* *measured*, on the run's second training step (the first with optimizer state), the real one.

What it costs: one fake step pair once (about a second for a 4-block GPT on the 2-core CPU) and one
tracked real step, so it runs only where it serves: where ``--memory-limit`` asks for it, or where an
accelerator's capacity is the budget and the model's own state could come near it (else every run on
a GPU would pay it for a device it uses a sliver of). Its seconds are autogaudi's cost in the
report's whole-run line. The watcher owns its code inside the user's
calls through the core's guard: where it raises, it goes silent and the run goes on.
"""

from __future__ import annotations

import copy
import gc
import time
import types
import weakref

import torch

from autogaudi import module_hooks
from autogaudi.events import Event
from autogaudi.model_call import Layer, trains
from autogaudi.unit import Scope

GB = 1024**3
PARTS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
# MemTracker's reference types as the report's parts; buffers count with the parameters.
_PART_OF = {
    "Parameter": "parameters",
    "Buffer": "parameters",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Temp": "temporaries",
    "Other": "activations",
}
# The share of an accelerator's capacity a step may plan to hold: the allocator's rounding and cache,
# the runtime's own buffers and what the script keeps outside the step take the rest.
CAPACITY_SHARE = 0.9
MATTERS_AT = 0.8  # the short report shows memory once a step's peak reaches this share of the budget
MEASURED_STEP = 1  # the training step measured (0-based): the first with the optimizer's state
# Without --memory-limit, a step is forecast only where the model's own state could take this share
# of the device's budget: parameters, gradients and two optimizer moments (Adam's, the most a common
# optimizer keeps) plus the batch. Below it, activations would have to be several times the whole
# state to run out, and the out-of-memory rescue is there for that case.
FORECAST_FROM = 0.25
STATE_COPIES = 4


def budget_bytes(options, backend):
    """The bytes a step may hold: ``--memory-limit`` where given (and below the device's capacity),
    else the share :data:`CAPACITY_SHARE` of an accelerator's; None on the CPU without a limit."""
    limit = int(options.memory_limit * GB) if getattr(options, "memory_limit", None) else None
    capacity = None
    if backend.name != "cpu":
        stats = backend.memory_stats()
        capacity = int(stats.total * CAPACITY_SHARE) if stats is not None else None
    known = [value for value in (limit, capacity) if value]
    return min(known) if known else None


def parts_of(snapshot: dict) -> dict:
    """A MemTracker peak snapshot ({device: {reference type: bytes}}) as the report's parts, summed
    over devices."""
    parts = dict.fromkeys(PARTS, 0)
    for per_type in snapshot.values():
        for kind, size in per_type.items():
            part = _PART_OF.get(getattr(kind, "value", None))
            if part is not None:
                parts[part] += size
    return parts


def peak_of(snapshot: dict) -> int:
    return sum(per_type.get("Total", 0) for per_type in snapshot.values())


def state_bytes(model, args) -> int:
    """An upper bound of what the model's training state and the batch hold: :data:`STATE_COPIES`
    copies of the parameters and buffers, and the batch's tensors. No forward runs."""
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    batch = sum(t.numel() * t.element_size() for t in _flat(list(args)) if isinstance(t, torch.Tensor))
    return STATE_COPIES * held + batch


def optimizer_of(model):
    """The optimizer holding most of ``model``'s parameters, or None. Found once, at the training
    model's first call, among the live objects: an optimizer is made before it steps, and no hook
    sees it made."""
    owned = {id(p) for p in model.parameters()}
    best, best_count = None, 0
    for candidate in gc.get_objects():
        if issubclass(type(candidate), torch.optim.Optimizer):  # type(): some objects warn on __class__
            count = sum(1 for group in candidate.param_groups for p in group["params"] if id(p) in owned)
            if count > best_count:
                best, best_count = candidate, count
    return best


class Forecast:
    """One prediction: the peak and its parts, and per module of interest what its forward keeps
    alive (``kept``: bytes from its start to its end, its output included) and returns (``output``)."""

    def __init__(self, peak: int, parts: dict, kept: dict, output: dict, checkpointed: tuple):
        self.peak = peak
        self.parts = parts
        self.kept = kept
        self.output = output
        self.checkpointed = checkpointed  # the names of the modules checkpointed in it


def _loss_of(output):
    """What the fake step backpropagates: a scalar among the outputs (a model that computes its
    loss), else the sum of every floating output that needs a gradient."""
    tensors = [t for t in _flat(output) if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    scalars = [t for t in tensors if t.dim() == 0]
    if scalars:
        return scalars[-1]
    return sum(t.float().sum() for t in tensors) if tensors else None


def _flat(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _flat(item)]
    values = getattr(output, "values", None)  # a Hugging Face ModelOutput
    return _flat(list(values())) if callable(values) else []


def _fake_optimizer(optimizer, fake_of: dict):
    """The same optimizer class over the fake parameters, its groups' settings and state as the
    original's (state tensors as fakes)."""
    groups = [
        {
            **{key: value for key, value in group.items() if key != "params"},
            "params": [fake_of[id(p)] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    return type(optimizer)(groups)


def predict(model, optimizer, args, kwargs, checkpointed=(), watch=()) -> Forecast:
    """The peak of one training step of ``model`` on fake tensors: a first step to create the
    optimizer's state, the second tracked. ``checkpointed``: names of submodules run under
    non-reentrant activation checkpointing in the copy; ``watch``: names of submodules whose kept
    and output bytes the forecast reports. The real model, its optimizer and the random generators
    are left as they were."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_of = {}
    for param in model.parameters():
        fake_of[id(param)] = torch.nn.Parameter(mode.from_tensor(param), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        fake_of[id(buffer)] = mode.from_tensor(buffer)
    memo = dict(fake_of)
    shadow = copy.deepcopy(model, memo)  # the route's slot is dropped by Module.__getstate__
    fake_args, fake_kwargs = _fake_inputs(mode, (args, kwargs))
    kept, output = {}, {}
    modules = dict(shadow.named_modules())
    for name in checkpointed:
        _checkpoint_copy(modules[name])
    for name in watch:
        _watch_copy(modules[name], name, kept, output)
    with torch.random.fork_rng(devices=[]), mode:
        fake_optimizer = _fake_optimizer(optimizer, fake_of) if optimizer is not None else None
        _fake_step(shadow, fake_optimizer, fake_args, fake_kwargs)
        kept.clear()
        output.clear()
        tracker = MemTracker()
        tracker.track_external(shadow, *([fake_optimizer] if fake_optimizer is not None else []))
        with tracker:
            _fake_step(shadow, fake_optimizer, fake_args, fake_kwargs)
    snapshot = tracker.get_tracker_snapshot("peak")
    return Forecast(peak_of(snapshot), parts_of(snapshot), dict(kept), dict(output), tuple(checkpointed))


def _fake_inputs(mode, value):
    if isinstance(value, torch.Tensor):
        return mode.from_tensor(value)
    if isinstance(value, tuple):
        return tuple(_fake_inputs(mode, item) for item in value)
    if isinstance(value, list):
        return [_fake_inputs(mode, item) for item in value]
    if isinstance(value, dict):
        return {key: _fake_inputs(mode, item) for key, item in value.items()}
    return value


def _fake_step(model, optimizer, args, kwargs) -> None:
    loss = _loss_of(model(*args, **kwargs))
    if loss is None:
        raise ValueError("no output that needs a gradient")
    loss.backward()
    if optimizer is not None:
        _unhooked_step(optimizer)(optimizer)
        optimizer.zero_grad()
    else:
        model.zero_grad()


def _unhooked_step(optimizer):
    """The optimizer class's step below torch's hook-calling wrappers (torch may wrap a class's step
    more than once, and autogaudi's units wrap it too): the session's step watcher would count a
    fake step as the user's."""
    step, below = type(optimizer).step, None
    while step is not None:
        if isinstance(step, types.FunctionType) and step.__dict__.get("hooked"):
            below = step.__wrapped__
        step = getattr(step, "__wrapped__", None)
    if below is None:
        raise TypeError(f"{type(optimizer).__name__}.step has no hook-calling wrapper of torch's")
    return below


def _checkpoint_copy(module) -> None:
    """The copy's ``module`` called through non-reentrant checkpointing, as the real one would be
    (the copy is autogaudi's own: its call slot may be set)."""
    from torch.utils.checkpoint import checkpoint

    call = module._call_impl

    def checkpointed(*args, **kwargs):
        return checkpoint(call, *args, use_reentrant=False, **kwargs)

    module._compiled_call_impl = checkpointed


def _watch_copy(module, name, kept, output) -> None:
    def before(_module, _args):
        kept[name] = -_live_bytes()

    def after(_module, _args, result):
        kept[name] = kept.get(name, 0) + _live_bytes()
        output[name] = sum(t.untyped_storage().nbytes() for t in _flat(result) if isinstance(t, torch.Tensor))

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)


def _live_bytes() -> int:
    """What the tracker of the step now being tracked counts live (0 outside one)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = _active_tracker(MemTracker)
    return peak_of(tracker.get_tracker_snapshot("current")) if tracker is not None else 0


def _active_tracker(kind):
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return next((mode for mode in reversed(_get_current_dispatch_mode_stack()) if isinstance(mode, kind)), None)


def _step_tracker():
    """A MemTracker that leaves torch's optimizer hooks alone: it closes at the end of the step, in
    the optimizer's post-hook, where taking a hook off would change the hooks torch is calling. The
    optimizer's state is tracked from the start (it exists from the first step on)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepTracker(MemTracker):
        """Its module hooks run inside the script's forward and backward, outside autogaudi's guard:
        one that raises (a model called twice in a step: accumulation, an LBFGS closure) stops the
        measurement instead of the script's call."""

        broken = None

        def _register_global_optimizer_hook(self) -> None:
            pass

        def _kept_out(self, hook, *args) -> None:
            if self.broken is not None:
                return
            try:
                hook(*args)
            except Exception as error:
                self.broken = error

        def _pre_fw_hook(self, *args) -> None:
            self._kept_out(super()._pre_fw_hook, *args)

        def _post_fw_hook(self, *args) -> None:
            self._kept_out(super()._post_fw_hook, *args)

        def _pre_bw_hook(self, *args) -> None:
            self._kept_out(super()._pre_bw_hook, *args)

        def _post_bw_hook(self, *args) -> None:
            self._kept_out(super()._post_bw_hook, *args)

    return StepTracker()


class StepMemory:
    """The session's watcher of a step's memory: the forecast at the training model's first call
    (:attr:`Event.MEMORY_FORECAST` lets a unit change the step and forecast it again before it
    runs), and the measurement of training step :data:`MEASURED_STEP`. A guard owner of its own."""

    def __init__(self, session):
        self.session = session
        self.budget = None
        self.enforced = False  # whether the device itself holds the process to --memory-limit
        self.failure = None
        # off (no budget), waiting, forecast, measuring, measured, not_measured, not_forecast,
        # far_below (the state is far below the device's budget: neither forecast nor measured), failed
        self.state = "off"
        self.forecast = None  # the forecast of the step as it runs (after any unit changed it)
        self.forecast_plain = None  # the first forecast, of the step as the script wrote it
        self.why_not = None  # what stopped the forecast, as text
        self.why_not_measured = None  # what stopped the measurement, as text
        self.measured = None  # (peak, parts) of the real step
        self.seconds = 0.0  # the forecasts' and the tracked step's time: autogaudi's cost
        self.state_bytes = None  # the bound of the model's state and batch (:func:`state_bytes`)
        self._tracking_since = None
        self._model = None
        self._optimizer = None
        self._tracker = None
        self._optimizer_steps_at_start = 0  # the optimizer steps when the tracked step began
        self._forecasting = False
        self._scope = Scope(self)
        self._limit = Scope(self)

    @property
    def in_force(self) -> bool:
        return self.failure is None

    def is_training_call(self, module) -> bool:
        """Whether a call of ``module`` may be the training model's: gradients on, trainable
        parameters, and not a forecast's call on a fake copy."""
        return not self._forecasting and trains(module)

    def failed_at_run_time(self, error: Exception) -> None:
        if self.failure is None:
            self.failure = repr(error)
            self.state = "failed"
            self._stop_tracking()
            self._scope.close()

    def install(self) -> None:
        self.budget = budget_bytes(self.session.options, self.session.backend)
        if self.budget is None:
            return
        limit = self.session.options.memory_limit
        undo = self.session.backend.limit_memory(int(limit * GB)) if limit else None
        self.enforced = undo is not None
        if undo is not None:
            self._limit.add(undo)  # for the whole session, not only until the measured step
        self.state = "waiting"
        self._first = self._scope.child()
        self._first.hook(module_hooks.register_forward_pre_hook, self._called)
        self.session.events.rank(self, -1)  # its tracker closes before a census opens at the same step's end
        handle = self.session.events.on(Event.TRAINING_STEP, self, self._step_ended)
        self._scope.add(handle.remove)
        self._scope.add(self._stop_tracking)

    def uninstall(self) -> None:
        self._scope.close()
        self._limit.close()

    def _called(self, module, args) -> None:
        """The first call with gradients of a module with trainable parameters: the training model."""
        if not self.is_training_call(module):
            return
        self._first.close()
        self._first_call(module, args)

    def _first_call(self, model, args) -> None:
        """Forecast the step where it serves, then tell the units what came of it, whatever that was
        (:attr:`Event.MEMORY_FORECAST`: activation_checkpointing decides on it)."""
        self._forecast_first(model, args)
        self.session.events.emit(Event.MEMORY_FORECAST, model, args, self)

    def _forecast_first(self, model, args) -> None:
        from autogaudi.model_call import compiled_by_the_script

        if compiled_by_the_script(model) or isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self.state, self.why_not = "not_forecast", f"{type(model).__name__} is compiled or distributed"
            return
        self.state_bytes = state_bytes(model, args)
        if not self.session.options.memory_limit and self.state_bytes < FORECAST_FROM * self.budget:
            self.state = "far_below"
            self._scope.close()  # no tracked step either: the device's own peak counter is the report's
            return
        optimizer = optimizer_of(model)
        self._optimizer = weakref.ref(optimizer) if optimizer is not None else None
        self._model = weakref.ref(model)
        self._scope.hold(model, Layer.TRACK, self._around_call)
        try:
            self.forecast = self.forecast_plain = self.again(model, args)
        except Exception as error:  # a forward fake tensors cannot run: measured only
            self.state, self.why_not = "not_forecast", repr(error)
            return
        self.state = "forecast"

    def again(self, model, args, checkpointed=(), watch=()) -> Forecast:
        """A forecast of the step called with ``args``, with ``checkpointed`` submodules (names)
        checkpointed; ``watch``: the submodules whose kept and output bytes it reports."""
        optimizer = self._optimizer() if self._optimizer is not None else None
        self._forecasting = True  # the copy's calls are no training model's
        began = time.perf_counter()
        try:
            with self.session.steps.unseen():
                return predict(model, optimizer, args, {}, checkpointed=checkpointed, watch=watch)
        finally:
            self._forecasting = False
            self.seconds += time.perf_counter() - began

    def _around_call(self, call, args, kwargs):
        """The training model's call: the measured step's first one runs inside the tracker, which
        sees the model's own hooks and every op of the forward, backward and optimizer step."""
        training = torch.is_grad_enabled()  # an evaluation pass (no_grad) between steps is no step's start
        if self._tracker is None and self.measured is None and training and self.session.steps.steps == MEASURED_STEP:
            self._start_tracking(self._model())
        elif self._tracker is not None and self.session.steps.optimizer_steps > self._optimizer_steps_at_start:
            self._step_ended(None)  # the step is whole: an evaluation (generate) runs between its end and the next
        return call(*args, **kwargs)

    def _start_tracking(self, model) -> None:
        optimizer = self._optimizer() if self._optimizer is not None else None
        tracker = _step_tracker()
        tracker.track_external(model, *([optimizer] if optimizer is not None else []))
        self._tracking_since = time.perf_counter()
        tracker.__enter__()
        self._tracker = tracker
        self._optimizer_steps_at_start = self.session.steps.optimizer_steps
        self.state = "measuring"

    def _step_ended(self, _optimizer) -> None:
        if self._tracker is not None:
            broken = self._tracker.broken
            if broken is None:
                snapshot = self._tracker.get_tracker_snapshot("peak")
                self.measured = (peak_of(snapshot), parts_of(snapshot))
            self._stop_tracking()
            self.state = "measured" if broken is None else "not_measured"
            self.why_not_measured = None if broken is None else repr(broken)
            self._scope.close()

    def _stop_tracking(self) -> None:
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.__exit__(None, None, None)
            # the tracked step whole: an upper bound of what tracking added (one plain step's time over)
            self.seconds += time.perf_counter() - self._tracking_since

    def report(self) -> dict:
        """The report's ``memory`` part: bytes, and None for what was not forecast or measured."""
        measured = self.measured
        forecast = self.forecast
        peak = measured[0] if measured else None
        matters = bool(self.budget and peak and peak >= MATTERS_AT * self.budget)
        return {
            "budget_bytes": self.budget,
            "limit_enforced": self.enforced,
            "state": self.state,
            "peak_bytes": peak,
            "predicted_peak_bytes": forecast.peak if forecast else None,
            "parts": measured[1] if measured else (forecast.parts if forecast else None),
            "parts_from": "measured" if measured else ("predicted" if forecast else None),
            "predicted_parts": forecast.parts if forecast else None,
            "not_forecast": self.why_not,
            "not_measured": self.why_not_measured,
            "failure": self.failure,
            "matters": matters,
            "state_bytes": self.state_bytes,
            "measuring_s": round(self.seconds, 3),
        }
