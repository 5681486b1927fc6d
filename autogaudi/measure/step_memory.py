"""The anatomy of a training step's memory, measured on the run's own first steps.

Why: the exit report's peak figure alone gives nothing to act on; what a step holds at its peak —
parameters, gradients, optimizer state, activations, temporaries — says what would bring it down
(checkpointing frees activations, a smaller optimizer state its share). The figures come from
torch's own tracker, ``torch.distributed._tools.mem_tracker.MemTracker`` (a dispatch mode that files
every tensor a step creates under one of those parts, and per module what its forward kept alive).

It tracks the training model's first training step, the real one: nothing of the script runs on a
copy or more often than in a plain run (a forecast on fake tensors ran the script's forward where
its prints, hooks and Python random draws saw it). The *forecast* of the steps after is that step's
peak, or where higher its peak before the optimizer step plus the optimizer state the step created;
units hear it at the step's end (:attr:`Event.MEMORY_FORECAST`) and act from the second step. The
second step (the first with the optimizer's state) is measured too, and any step after a unit
changed the steps: the report's measured peak is the last one's.

What it costs: the tracked steps (a Python dispatch mode over each op), so it runs only where it
serves: where ``--memory-limit`` asks for it, or where an accelerator's capacity is the budget and
the model's own state could come near it. Their seconds are autogaudi's cost in the report's
whole-run line. The watcher owns its code inside the user's calls through the core's guard: where
it raises, it goes silent and the run goes on.
"""

from __future__ import annotations

import time
import warnings
import weakref

import torch

from autogaudi.core.events import Event
from autogaudi.core.unit import Scope
from autogaudi.watch import module_hooks
from autogaudi.watch.model_call import Layer, trains

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
MEASURED_STEP = 1  # the last training step always measured (0-based): the first with the optimizer's state
# Without --memory-limit, a step is forecast only where the model's own state could take this share
# of the device's budget: parameters, gradients and two optimizer moments (Adam's, the most a common
# optimizer keeps) plus the batch. Below it, activations would have to be several times the whole
# state to run out, and the out-of-memory rescue is there for that case.
FORECAST_FROM = 0.25
STATE_COPIES = 4
# A tracked step whose model is called this many times more with no backward pass is no training step
# (inference that forgot no_grad): the tracker goes. An inner loop (MAML, a gradient penalty) stays below.
CALLS_WITHOUT_BACKWARD = 16


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


class Forecast:
    """One prediction of a training step: the peak and its parts; per module of the model its forward
    ran in (by name), what that forward kept alive (``kept``: bytes from its start to its end, its
    output included) and returned (``output``); ``checkpointed``: the modules checkpointed in it;
    ``under_saved_tensor_hooks``: the modules whose forward ran inside saved-tensor hooks (the
    script's own checkpointing or offloading)."""

    def __init__(self, peak: int, parts: dict, kept=None, output=None, checkpointed=(), under_saved_tensor_hooks=()):
        self.peak = peak
        self.parts = parts
        self.kept = kept or {}
        self.output = output or {}
        self.checkpointed = tuple(checkpointed)
        self.under_saved_tensor_hooks = frozenset(under_saved_tensor_hooks)

    def without(self, names) -> Forecast:
        """This step with ``names`` checkpointed as well: each frees what its forward keeps alive
        beyond its output (a checkpointed block keeps its inputs, which its caller holds anyway)."""
        freed = sum(max(0, self.kept.get(name, 0) - self.output.get(name, 0)) for name in names)
        parts = {**self.parts, "activations": max(0, self.parts.get("activations", 0) - freed)}
        return Forecast(
            self.peak - freed,
            parts,
            self.kept,
            self.output,
            (*self.checkpointed, *names),
            self.under_saved_tensor_hooks,
        )


def _flat(output):
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _flat(item)]
    values = getattr(output, "values", None)  # a Hugging Face ModelOutput
    return _flat(list(values())) if callable(values) else []


def _step_tracker():
    """A MemTracker for one real training step. It hears the optimizer's step through the session's
    events, not torch's optimizer hooks: it closes in the optimizer's post-hook, where taking a hook
    off would change the hooks torch is calling."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class StepTracker(MemTracker):
        """Its module hooks run inside the script's forward and backward, outside autogaudi's guard:
        one that raises stops the measurement instead of the script's call, and what they warn is
        not the script's to see. A model called again in
        the step (gradient accumulation) is measured call after call: torch's tracker refuses that."""

        broken = None

        def __init__(self):
            super().__init__()
            self.under_saved_tensor_hooks = weakref.WeakSet()

        def _register_global_optimizer_hook(self) -> None:
            pass

        def joined_during(self, model, args) -> None:
            """Entered from ``model``'s forward pre-hook: its call is under way, and torch's tracker
            never saw it start."""
            self._kept_out(self._mod_tracker._fw_pre_hook, model, args)

        def optimizer_step(self, optimizer, starts: bool) -> None:
            """What MemTracker's own optimizer hooks do: the state the step creates is the optimizer's."""
            self._kept_out(self._track_optimizer_states, _MemRefType.OPT, optimizer)
            self._in_opt = starts

        def _kept_out(self, hook, *args) -> None:
            if self.broken is not None:
                return
            try:
                with warnings.catch_warnings():  # torch's tracker reads .grad of non-leaf stand-ins (functional calls)
                    warnings.simplefilter("ignore")
                    hook(*args)
            except Exception as error:
                self.broken = error

        def _pre_fw_hook(self, module, inputs) -> None:
            self._kept_out(self._called, module, inputs)

        def _called(self, module, inputs) -> None:
            tracker = self._mod_tracker
            if not tracker.is_bw:
                if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
                    self.under_saved_tensor_hooks.add(module)
                name = tracker.get_known_fqn(module)
                if module in self.memory_tracking and set(tracker.parents) - {name} == {"Global"}:
                    del self.memory_tracking[module]  # the root called again in the step
            super()._pre_fw_hook(module, inputs)

        def _post_fw_hook(self, *args) -> None:
            self._kept_out(super()._post_fw_hook, *args)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            """Gradient hooks only on leaves: a functional call's stand-in parameters (fast weights)
            are computed tensors, which take none."""
            leaves = all(p.is_leaf for p in module.parameters())
            return super()._track_module_params_and_buffers(module, install_grad_hooks and leaves)

        def _pre_bw_hook(self, *args) -> None:
            self._kept_out(super()._pre_bw_hook, *args)

        def _post_bw_hook(self, *args) -> None:
            self._kept_out(super()._post_bw_hook, *args)

        def forecast(self, model, peak_before_step) -> Forecast:
            """The steps after this one: its peak, or where higher its peak before the optimizer step
            with the optimizer's state as it is now (the first step creates it, the later ones hold
            it throughout); per module of ``model``, what its forward kept alive and returned."""
            from torch.distributed._tools.mem_tracker import _ModState

            snapshot = self.get_tracker_snapshot("peak")
            peak, parts = peak_of(snapshot), parts_of(snapshot)
            if peak_before_step is not None:
                before, before_parts = peak_before_step
                state = parts_of(self.get_tracker_snapshot("current"))["optimizer_state"]
                grown = before + state - before_parts["optimizer_state"]
                if grown > peak:
                    peak, parts = grown, {**before_parts, "optimizer_state": state}
            kept, output, hooked = {}, {}, set()
            for name, module in model.named_modules():
                stats = self.memory_tracking.get(module)
                if stats is None or not stats.snapshots.get(_ModState.POST_FW):
                    continue
                start, end = stats.snapshots[_ModState.PRE_FW][-1], stats.snapshots[_ModState.POST_FW][-1]
                kept[name] = peak_of(end) - peak_of(start)
                output[name] = stats.output_mem
                if module in self.under_saved_tensor_hooks:
                    hooked.add(name)
            return Forecast(peak, parts, kept, output, under_saved_tensor_hooks=hooked)

    return StepTracker()


class StepMemory:
    """The session's watcher of a step's memory: the training model's first training step measured
    (:attr:`Event.MEMORY_FORECAST` at its end lets a unit change the steps after it), then the second
    (the first with the optimizer's state), and each step after a unit changed the step again
    (:meth:`measure_next`). A guard owner of its own."""

    def __init__(self, session):
        self.session = session
        self.budget = None
        self.enforced = False  # whether the device itself holds the process to --memory-limit
        self.failure = None
        # off (no budget), waiting, measuring, measured, not_measured, not_forecast, far_below (the
        # state is far below the device's budget: not measured), failed
        self.state = "off"
        self.forecast = None  # the forecast of the steps as they run (after any unit changed them)
        self.forecast_plain = None  # the first forecast, of the steps as the script wrote them
        self.why_not = None  # what stopped the forecast, as text
        self.why_not_measured = None  # what stopped the measurement, as text
        self.measured = None  # (peak, parts) of the last real step measured
        self.seconds = 0.0  # the tracked steps' time: autogaudi's cost
        self.state_bytes = None  # the bound of the model's state and batch (:func:`state_bytes`)
        self._tracking_since = None
        self._model = None
        self._owned = frozenset()  # ids of the training model's parameters
        self._optimizer = None
        self._tracker = None
        self._peak_before_step = None  # (peak, parts) of the tracked step before its optimizer step
        self._optimizer_steps_at_start = 0  # the optimizer steps when the tracked step began
        self._backwards_at_start = 0  # and the backward passes
        self._calls_tracked = 0  # the model's calls since, while no backward pass ran
        self._measure_at = None  # the training step to measure next, if any
        self._scope = Scope(self)
        self._limit = Scope(self)

    @property
    def in_force(self) -> bool:
        return self.failure is None

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
        events = self.session.events
        events.rank(self, -1)  # its tracker closes before a census opens at the same step's end
        for event, listener in (
            (Event.TRAINING_STEP, self._step_ended),
            (Event.BEFORE_OPTIMIZER_STEP, self._optimizer_step_starts),
            (Event.OPTIMIZER_STEP, self._optimizer_step_ended),
        ):
            self._scope.add(events.on(event, self, listener).remove)
        self._scope.add(self._stop_tracking)

    def uninstall(self) -> None:
        self._scope.close()
        self._limit.close()

    def _called(self, module, args) -> None:
        """The first call with gradients of a module with trainable parameters: the training model."""
        if not trains(module):
            return
        self._first.close()
        self._first_call(module, args)

    def _first_call(self, model, args) -> None:
        """Measure this first training step where it serves; where it does not, tell the units now
        (:attr:`Event.MEMORY_FORECAST` with no forecast)."""
        from autogaudi.watch.model_call import compiled_by_the_script

        if compiled_by_the_script(model) or isinstance(model, torch.nn.parallel.DistributedDataParallel):
            self.state, self.why_not = "not_forecast", f"{type(model).__name__} is compiled or distributed"
        else:
            self.state_bytes = state_bytes(model, args)
            if self.session.options.memory_limit or self.state_bytes >= FORECAST_FROM * self.budget:
                self._model = weakref.ref(model)
                self._owned = frozenset(id(p) for p in model.parameters())
                self._scope.hold(model, Layer.TRACK, self._around_call)
                self._start_tracking(model, joined=args)
                return
            self.state = "far_below"
        self._scope.close()  # nothing tracked: the device's own peak counter is the report's
        self.session.events.emit(Event.MEMORY_FORECAST, model, self)

    def measure_next(self) -> None:
        """A unit changed the steps: measure the next training step as well."""
        self._measure_at = self.session.steps.steps

    def _around_call(self, call, args, kwargs):
        """The training model's call: a step to measure starts with it (the tracker then sees the
        model's own hooks and every op of the forward, backward and optimizer step)."""
        training = torch.is_grad_enabled()  # an evaluation pass (no_grad) between steps is no step's start
        steps = self.session.steps
        if self._tracker is None and training and steps.steps == self._measure_at:
            self._start_tracking(self._model())
        elif self._tracker is not None and steps.optimizer_steps > self._optimizer_steps_at_start:
            self._step_ended(None)  # the step is whole: an evaluation (generate) runs between its end and the next
        elif self._tracker is not None and training and steps.backwards == self._backwards_at_start:
            self._calls_tracked += 1
            if self._calls_tracked > CALLS_WITHOUT_BACKWARD:
                self._given_up(f"the model was called {self._calls_tracked} times and no backward pass followed")
        return call(*args, **kwargs)

    def _given_up(self, why: str) -> None:
        """A tracked call that starts no training step (a forward with gradients on and no backward
        after it: inference that forgot ``no_grad``): the tracker goes, and nothing is measured."""
        self._stop_tracking()
        self.state, self.why_not_measured = "not_measured", why
        self.why_not = self.why_not or why
        self._scope.close()
        model = self._model()
        if model is not None and self.forecast is None:
            self.session.events.emit(Event.MEMORY_FORECAST, model, self)

    def _start_tracking(self, model, joined=None) -> None:
        optimizer = self._optimizer() if self._optimizer is not None else None
        tracker = _step_tracker()
        tracker.track_external(model, *([optimizer] if optimizer is not None else []))
        self._tracking_since = time.perf_counter()
        tracker.__enter__()
        if joined is not None:
            tracker.joined_during(model, joined)
        self._tracker = tracker
        self._peak_before_step = None
        self._optimizer_steps_at_start = self.session.steps.optimizer_steps
        self._backwards_at_start = self.session.steps.backwards
        self._calls_tracked = 0
        self._measure_at = None
        self.state = "measuring"

    def _optimizer_step_starts(self, optimizer, _args, _kwargs) -> None:
        if self._tracker is None or not any(id(p) in self._owned for g in optimizer.param_groups for p in g["params"]):
            return
        if self._optimizer is None:
            self._optimizer = weakref.ref(optimizer)
        if self._peak_before_step is None:
            snapshot = self._tracker.get_tracker_snapshot("peak")
            self._peak_before_step = (peak_of(snapshot), parts_of(snapshot))
        self._tracker.optimizer_step(optimizer, starts=True)

    def _optimizer_step_ended(self, optimizer) -> None:
        if self._tracker is not None and self._optimizer is not None and optimizer is self._optimizer():
            self._tracker.optimizer_step(optimizer, starts=False)

    def _step_ended(self, _optimizer) -> None:
        tracker = self._tracker
        if tracker is None:
            return
        model = self._model()
        broken = tracker.broken
        forecast = tracker.forecast(model, self._peak_before_step) if broken is None and model is not None else None
        if broken is None:
            snapshot = tracker.get_tracker_snapshot("peak")
            self.measured = (peak_of(snapshot), parts_of(snapshot))
        self._stop_tracking()
        self.state = "measured" if broken is None else "not_measured"
        self.why_not_measured = None if broken is None else repr(broken)
        if forecast is None:
            self.why_not = self.why_not or self.why_not_measured
        else:
            self.forecast = forecast
            if self.forecast_plain is None:
                self.forecast_plain = forecast
        # the first step with the optimizer's state is measured too; a unit may ask for the next one
        self._measure_at = self.session.steps.steps if self.session.steps.steps <= MEASURED_STEP else None
        if model is not None:
            self.session.events.emit(Event.MEMORY_FORECAST, model, self)
        if broken is not None or self._measure_at is None:
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
