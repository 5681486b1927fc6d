"""Activation checkpointing of the fewest repeated blocks that bring a step's peak under budget.

Why: half of the HF single-GPU guide is memory, and activations are most of a transformer step's
peak (404 of 496 MB for a 6-block GPT at batch 32x128). Checkpointing a block keeps only its inputs
and runs its forward again in backward: a block's activations for about a third more compute in
it. So it is done only where the steps would not fit the budget (``--memory-limit``, or an
accelerator's capacity): the run's first training step is measured (:mod:`autogaudi.measure.step_memory`),
and from the second on the fewest blocks are checkpointed that bring its forecast under the budget;
each step after a change is measured again, and more blocks taken where it is still over.

How: the blocks are the children of the model's largest ``nn.ModuleList``/``nn.Sequential`` of one
class (a GPT's layers) that the first step called; those the script checkpoints itself, or whose
modules carry the script's hooks (they would run again), are left out. Each chosen block's call gets
the recompute layer of its call route (:mod:`autogaudi.watch.model_call`, nothing of it travels with the
module): ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` with torch's random state
preserved, the block's call passed through whole. The recomputation is a second run of the block's
Python forward, kept from the run: Python's and NumPy's random states set as the forward had them,
its buffers and attributes put back as the forward left them (:mod:`autogaudi.watch.forward_state`), what
it prints or logs discarded. A call with other parameters (``torch.func.functional_call``), inside
the script's own checkpoint or saved-tensor hooks, or without gradients runs plain.

Out of memory: where a budget is known, a training forward that runs out of device memory is rescued
once, from the model's second call on: the memory freed, the call's random state, buffers and
attributes put back (:mod:`autogaudi.watch.out_of_memory`), every block checkpointed, the call run again.
One raised outside the forward propagates as plain PyTorch's. Either way the decision is remembered
(with a cache) and the next run with the same script, model and inputs checkpoints the blocks from
its first step.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import weakref

import torch
from torch.utils.checkpoint import checkpoint

from autogaudi.core.events import Event
from autogaudi.core.unit import Unit, UnitSpec
from autogaudi.optimizations.step_profiler import training_model
from autogaudi.watch import forward_state, module_hooks, out_of_memory
from autogaudi.watch.model_call import Layer, compiled_by_the_script, route_of, trains
from autogaudi.watch.steps import clock


def repeated_blocks(model, called=None) -> tuple:
    """(container name, block names): the children of the model's ``nn.ModuleList`` or
    ``nn.Sequential`` of two or more modules of one class, the one with the most parameters; or
    ("", ()) where it has none. ``called``: the names of the modules a step called, where known;
    a container whose children it did not all call is no candidate."""
    best, best_size = ("", ()), 0
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        names = [f"{name}.{index}" if name else str(index) for index in range(len(module))]
        if called is not None and not set(names) <= called:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = (name, tuple(names)), size
    return best


def script_hooks(module) -> bool:
    """Whether ``module`` or a submodule carries a hook of the script's (forward, pre-forward or
    backward), or the script holds a global module hook: a recomputation would run it again."""
    for sub in module.modules():
        if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks or sub._backward_pre_hooks:
            return True
    from torch.nn.modules import module as torch_module

    own = {id(hook.fn) for hook in module_hooks._HELD}
    held = (*torch_module._global_forward_hooks.values(), *torch_module._global_forward_pre_hooks.values())
    return any(id(hook) not in own for hook in held) or bool(torch_module._global_backward_hooks)


def _parameters(module) -> tuple:
    return tuple(id(p) for _, p in module.named_parameters(remove_duplicate=False))


def _plain_call_now(block, parameters) -> bool:
    """Whether this call of a checkpointed ``block`` runs plain: no gradients; a recomputation or
    backward under way (the script's reentrant checkpointing); inside saved-tensor hooks (the
    script's own checkpoint or offloading); or with other parameters than its own (a functional call,
    whose recomputation in backward would meet the module's own)."""
    return (
        not torch.is_grad_enabled()
        or torch._C._current_graph_task_id() != -1
        or torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
        or _parameters(block) != parameters
    )


@contextlib.contextmanager
def _kept_quiet():
    """What the recomputation prints (``sys.stdout``/``sys.stderr``) or logs goes nowhere: the
    forward said it once."""
    sink = io.StringIO()
    was = logging.root.manager.disable
    configured = bool(logging.root.handlers)  # else a record goes to logging's last resort: sys.stderr, redirected
    if configured:
        logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        if configured:
            logging.disable(was)


def _where(where: str) -> str:
    return "in the training forward" if where == "forward" else "outside the forward (backward, loss or optimizer)"


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


class ActivationCheckpointing(Unit):
    spec = UnitSpec(
        reasons={
            "waiting_for_forecast": "waiting for the measurement of the training model's first step",
            "not_forecast": "the step could not be measured ({why}); nothing changed",
            "fits": "the step's peak {peak} fits the budget {budget}",
            "far_below": "the model's state and batch ({state}) are far below the device's budget {budget}: not "
            "measured",
            "no_blocks": "the step's peak {peak} exceeds the budget {budget}, and {model} has no repeated blocks (a "
            "ModuleList or Sequential of one class) that the step calls and that could be checkpointed",
            "blocks_held": "the step's peak {peak} exceeds the budget {budget}; {held} holds a layer of "
            "{model}'s blocks",
            "checkpointed": "{count} of {total} blocks of {container} checkpointed from step {step}: the forecast peak "
            "{before} -> {after}, budget {budget}; their Python forward runs again in backward",
            "still_over": "every block that could be checkpointed is, and the forecast peak {after} still exceeds the "
            "budget {budget}",
            "left_out": "{count} of {total} blocks of {container} not checkpointed: {why}",
            "rescued": "the training forward ran out of memory at step {step}: memory freed, its random state and "
            "{buffers} updated buffer(s) put back, {count} of {total} blocks of {container} checkpointed, the call run "
            "again",
            "out_of_memory_remembered": "{count} of {total} blocks of {container} checkpointed from the first step: an "
            "earlier run (on {date}) ran out of memory {where} at step {step}",
            "not_rescued": "out of memory {where} at step {step}: raised as plain PyTorch raises it",
            "not_rescuable": "{model} is compiled by the script or distributed: a forward that runs out of memory is "
            "not run again",
            "next_run": "the next run with this script, model and inputs checkpoints {count} of {total} blocks of "
            "{container} from its first step",
            "next_run_no_cache": "with the cache on (--no-cache off), the next run would checkpoint {count} of {total} "
            "blocks of {container} from its first step",
            "next_run_no_blocks": "{model} has no repeated blocks to checkpoint: a smaller batch, gradient "
            "accumulation or a smaller optimizer state would bring the step down",
        },
        changed_figure=("blocks_checkpointed", ""),
        acts_on=("<training model>'s repeated blocks: call route, recompute layer (torch.utils.checkpoint)",),
    )

    def apply(self) -> None:
        self._recompute_s = 0.0
        self._steps_since = None
        self._model = None  # the training model (weakly), once called
        self._inputs = ()  # the shapes of its first call's positional inputs: the remembered decision's key
        self._held: dict = {}  # block name -> module, checkpointed by this unit
        self._blocks = None  # (container, names, candidates) once the first step is measured
        self._left_out = []  # (count, why) of the blocks that are no candidates
        self._state = out_of_memory.CallState(self.run.backend.name)
        self._rescued = False
        self._remembered = False  # an out-of-memory error of this run has been remembered for the next
        self._first = self.scope.child()
        self._first.hook(module_hooks.register_forward_pre_hook, self._called)
        self.scope.add(self._forget)
        if self.run.step_memory is None or self.run.step_memory.budget is None:
            self.run.trials.measured(self)
            self.report.because("no_budget")
            return
        self.report.because("waiting_for_forecast")
        self.scope.on(Event.MEMORY_FORECAST, self._forecast)

    def _forget(self) -> None:
        self._held.clear()
        self._model = None

    def _called(self, module, args) -> None:
        """The first call with gradients of a module with trainable parameters: the training model.
        Its blocks are checkpointed now where an earlier run ran out of memory; its later calls run
        through the rescue layer."""
        if not trains(module):
            return
        self._first.close()
        self._model = weakref.ref(module)
        self._inputs = training_model.input_shapes(args, {})
        memory = self.run.step_memory
        if memory is None or memory.budget is None:  # no memory that could run out: nothing remembered, no layer
            return
        remembered = self.run.memory.recall_memory(module, self._inputs) if self.run.memory else None
        if remembered is not None and not self._held:
            self._recall(module, remembered)
        if compiled_by_the_script(module) or isinstance(module, torch.nn.parallel.DistributedDataParallel):
            self.report.note("not_rescuable", model=type(module).__name__)
            return
        self.scope.hold(module, Layer.RESCUE, self._rescue)

    def _recall(self, model, remembered: dict) -> None:
        container, names = repeated_blocks(model)
        names = tuple(name for name in names if name in remembered["blocks"]) or names
        if not self._checkpoint(model, names):
            return
        self.run.trials.measured(self)
        self.report.figures.update(checkpointed_from_step=self.run.steps.steps, remembered_on=remembered["date"])
        self.report.because(
            "out_of_memory_remembered",
            count=len(names),
            total=len(names),
            container=container or type(model).__name__,
            date=remembered["date"],
            where=_where(remembered["where"]),
            step=remembered["step"],
        )

    def _checkpoint(self, model, names) -> bool:
        """Every block of ``names`` not checkpointed yet held with the recompute layer; False where
        there are none, or another unit holds a layer of one."""
        modules = dict(model.named_modules())
        todo = [name for name in names if name not in self._held]
        if not names or any(route_of(modules[name]) is not None for name in todo):
            return False
        for name in todo:
            block = modules[name]
            self.scope.hold(
                block, Layer.RECOMPUTE, functools.partial(self._recompute, weakref.ref(block), _parameters(block))
            )
            self._held[name] = block
        self.report.figures["blocks_checkpointed"] = list(self._held)
        if self._steps_since is None:
            self._steps_since = self.run.steps.steps
            self.scope.on(Event.TRAINING_STEP, self._step_ended)
        return True

    def _rescue(self, call, args, kwargs):
        """The training model's call; where its forward runs out of memory (once a run), the call is
        run again with every block checkpointed, as if it had not run."""
        model = self._model() if self._model is not None else None
        if self._rescued or model is None or not torch.is_grad_enabled():
            return call(*args, **kwargs)
        self._state.take(model)
        try:
            result = call(*args, **kwargs)
        except Exception as error:
            if not out_of_memory.is_out_of_memory(error):
                raise
            if not self._rescuable(model):
                raise
        else:
            self._state.drop()
            return result
        # Outside the except clause. The guard keeps the error until all of this is done (where any of
        # it raises, the user gets the error as plain PyTorch's), then lets it go with the forward's
        # tensors its traceback holds, before the memory is freed.
        self._rescued = True
        self._say_left_out(model)
        buffers = self._state.put_back()
        container, names, candidates = self._candidates(model)
        step = self.run.steps.steps
        self._remember("forward", step)
        self.report.figures["rescued_at_step"] = step
        self.report.because(
            "rescued",
            step=step,
            buffers=buffers,
            count=len(candidates),
            total=len(names),
            container=container or type(model).__name__,
        )
        self.report.moment("rescued", at_step=step)
        call.raised = None
        out_of_memory.release()
        return call(*args, **kwargs)  # where it runs out of memory again, that propagates as plain's

    def _rescuable(self, model) -> bool:
        """Whether every block could be checkpointed (then it is); the error propagates where not."""
        if self._checkpoint(model, self._candidates(model)[2]):
            return True
        self._remember("forward", self.run.steps.steps)
        return False

    def _candidates(self, model) -> tuple:
        """(container, its blocks, those that can be checkpointed): the blocks the first measured step
        called, less those the script checkpoints itself and those with the script's hooks (kept
        once found, with why, in ``_left_out``)."""
        if self._blocks is not None:
            return self._blocks
        forecast = self.run.step_memory.forecast_plain
        called = set(forecast.kept) if forecast is not None else None  # not measured: the blocks the model holds
        container, names = repeated_blocks(model, called=called)
        own = [name for name in names if forecast is not None and name in forecast.under_saved_tensor_hooks]
        hooked = [name for name in names if name not in own and script_hooks(model.get_submodule(name))]
        self._left_out = [
            (len(own), "the script checkpoints them itself"),
            (len(hooked), "a hook of the script's would run again"),
        ]
        candidates = tuple(name for name in names if name not in own and name not in hooked)
        if forecast is not None:
            self._blocks = container, names, candidates
        return container, names, candidates

    def _say_left_out(self, model) -> None:
        container, names, _ = self._candidates(model)
        for count, why in self._left_out:
            if count:
                self.report.note(
                    "left_out", count=count, why=why, total=len(names), container=container or type(model).__name__
                )

    def run_ending(self, error) -> None:
        """The run ends with ``error`` raised through the script (None: it did not): an out-of-memory
        one is remembered for the next run."""
        model = self._model() if self._model is not None else None
        if model is None or error is None or not out_of_memory.is_out_of_memory(error):
            return
        step = self.run.steps.steps
        where = "forward" if self._remembered else "outside_forward"
        self.report.note("not_rescued", where=_where(where), step=step)
        if not self._remembered:
            self._remember(where, step)

    def _remember(self, where: str, step: int) -> None:
        self._remembered = True
        model = self._model()
        container, _, names = self._candidates(model)
        sizes = {"count": len(names), "total": len(names), "container": container or type(model).__name__}
        if not names:
            next_run = self.report.reason_for("next_run_no_blocks", model=type(model).__name__)
        elif self.run.memory is None:
            next_run = self.report.reason_for("next_run_no_cache", **sizes)
        else:
            decision = {"blocks": list(names), "where": where, "step": step}
            self.run.memory.remember_memory(model, self._inputs, decision)
            next_run = self.report.reason_for("next_run", **sizes)
        self.report.figures["next_run"] = {"code": next_run.code, "what": next_run.text}

    def _forecast(self, model, memory) -> None:
        """A step was measured (or could not be): checkpoint the fewest more blocks that bring the
        forecast of the steps after it under the budget, and have the next step measured."""
        self.run.trials.measured(self)
        forecast, budget = memory.forecast, memory.budget
        if memory.state == "far_below":
            self.report.because("far_below", state=_mb(memory.state_bytes), budget=_mb(budget))
            return
        if forecast is None:
            if not self._held:
                self.report.because("not_forecast", why=memory.why_not)
            return
        container, names, candidates = self._candidates(model)  # once, with no tracker's hooks about
        sizes = {"peak": _mb(forecast.peak), "budget": _mb(budget)}
        if forecast.peak <= budget:
            if not self._held:
                self.report.because("fits", **sizes)
            return
        self._say_left_out(model)
        todo = [name for name in candidates if name not in self._held]
        if not todo:
            if self._held:
                self.report.note("still_over", after=_mb(forecast.peak), budget=_mb(budget))
            else:
                self.report.because("no_blocks", model=type(model).__name__, **sizes)
            return
        modules = dict(model.named_modules())
        held = [route_of(modules[name]) for name in todo if route_of(modules[name]) is not None]
        if held:
            owner = next(iter(held[0].layers.values()))[0]
            self.report.because(
                "blocks_held", held=getattr(owner, "name", type(owner).__name__), model=type(model).__name__, **sizes
            )
            return
        chosen = _fewest(forecast, todo, budget)
        self._checkpoint(model, chosen)
        after = forecast.without(chosen)
        memory.forecast = after
        memory.measure_next()
        self.report.figures.update(
            forecast_peak_bytes_plain=memory.forecast_plain.peak, forecast_peak_bytes=after.peak, budget_bytes=budget
        )
        self.report.because(
            "checkpointed",
            count=len(self._held),
            total=len(names),
            container=container or type(model).__name__,
            step=self.run.steps.steps,
            before=_mb(memory.forecast_plain.peak),
            after=_mb(after.peak),
            budget=_mb(budget),
        )
        self.report.moment("checkpointed", blocks=len(self._held))

    def _recompute(self, block_ref, parameters, call, args, kwargs):
        """A checkpointed block's call, passed through whole (its keywords are the block's, never
        checkpoint's own), unless it must run plain (:func:`_plain_call_now`)."""
        block = block_ref()
        if block is None or _plain_call_now(block, parameters):
            return call(*args, **kwargs)
        python_random = forward_state.python_random_states()
        keys = tuple(kwargs)

        def run(*flat):
            positional, keywords = flat[: len(flat) - len(keys)], dict(zip(keys, flat[len(flat) - len(keys) :]))
            if torch._C._current_graph_task_id() == -1:  # the forward itself
                return call(*positional, **keywords)
            return self._again(block, call.wrapped, positional, keywords, python_random)

        # every input positional: torch finds the devices whose random state it preserves among them
        return checkpoint(run, *args, *kwargs.values(), use_reentrant=False, preserve_rng_state=True)

    def _again(self, block, forward, args, kwargs, python_random):
        """The recomputation, timed (what checkpointing costs per step) and kept from the run: Python's
        random state as the forward had it and back after, the block's buffers and attributes as the
        forward left them, its prints and logs discarded. It calls the block itself, not the guard's
        record of the user's call: torch stops it early with an exception that the record would keep,
        and with it the recomputed tensors."""
        start = clock()
        state = forward_state.ModuleState(block)
        random_now = forward_state.python_random_states()
        try:
            forward_state.set_python_random_states(python_random)
            with _kept_quiet():
                return forward(*args, **kwargs)
        finally:
            forward_state.set_python_random_states(random_now)
            state.put_back()
            self._recompute_s += clock() - start

    def _step_ended(self, _optimizer) -> None:
        steps = self.run.steps.steps - self._steps_since
        if steps > 0:
            self.report.figures["recompute_ms_per_step"] = round(self._recompute_s * 1000 / steps, 3)

    def changes(self) -> list:
        figures = self.report.figures
        blocks = figures.get("blocks_checkpointed")
        if not blocks:
            return []
        cost = figures.get("recompute_ms_per_step")
        cost = (
            f"; recomputing them (their Python forward run again) costs {cost} ms per step" if cost is not None else ""
        )
        if "forecast_peak_bytes" not in figures:  # rescued or remembered: the reason says why
            return [f"{len(blocks)} block(s) checkpointed ({', '.join(blocks)}): {self.report.reason.text}{cost}"]
        measured = self.run.step_memory.measured
        peak = f", measured {_mb(measured[0])}" if measured else ""
        return [
            f"{len(blocks)} block(s) checkpointed ({', '.join(blocks)}): forecast peak "
            f"{_mb(figures['forecast_peak_bytes_plain'])} -> {_mb(figures['forecast_peak_bytes'])}{peak}, "
            f"budget {_mb(figures['budget_bytes'])}{cost}"
        ]


def _fewest(forecast, names, budget) -> list:
    """The fewest leading ``names`` whose checkpointing brings ``forecast`` under ``budget`` (all of
    them where none do)."""
    over, freed = forecast.peak - budget, 0
    for count, name in enumerate(names, 1):
        freed += max(0, forecast.kept.get(name, 0) - forecast.output.get(name, 0))
        if freed >= over:
            return list(names[:count])
    return list(names)
