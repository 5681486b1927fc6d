"""Activation checkpointing of the fewest repeated blocks that bring a step's forecast peak under budget.

Why: half of the HF single-GPU guide is memory, and activations are most of a transformer step's
peak (404 of 496 MB for a 6-block GPT at batch 32x128). Checkpointing a block keeps only its inputs
and runs its forward again in backward: a block's activations for about a third more compute in
it. So it is done only where the step would not fit: where the forecast of the first step
(:mod:`autogaudi.step_memory`, on fake tensors, before the first real forward) exceeds the budget
(``--memory-limit``, or an accelerator's capacity), on the fewest blocks that bring the forecast
under it, each choice forecast again before it is taken.

How: the blocks are the children of the model's largest ``nn.ModuleList``/``nn.Sequential`` of one
class (a GPT's layers); each chosen block's call gets the recompute layer of its call route
(:mod:`autogaudi.model_call`, nothing of it travels with the module), which runs the block through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` with the random state preserved, so
dropout draws the same masks in the recomputation. Revert takes the layers off.

Out of memory: where the forecast fell short of a budget (``--memory-limit``, or an accelerator's
memory), a training forward that runs out of device memory is rescued once, from the model's second
call on:
the memory freed, the call's random state and updated buffers put back
(:mod:`autogaudi.out_of_memory`), every block checkpointed, the call run again. One raised outside
the forward (backward, loss, optimizer) propagates as plain PyTorch's: that step cannot be run
again. Either way the decision is remembered (with a cache) and the next run with the same
script, model and inputs checkpoints the blocks from its first step.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from autogaudi import module_hooks, out_of_memory
from autogaudi.events import Event
from autogaudi.model_call import Layer, compiled_by_the_script, route_of, trains
from autogaudi.status import Status
from autogaudi.steps import clock
from autogaudi.unit import Unit


def repeated_blocks(model) -> tuple:
    """(container name, block names): the children of the model's ``nn.ModuleList`` or
    ``nn.Sequential`` of two or more modules of one class, the one with the most parameters; or
    ("", ()) where it has none."""
    best, best_size = ("", ()), 0
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = (
                (name, tuple(f"{name}.{index}" if name else str(index) for index in range(len(module)))),
                size,
            )
    return best


def _where(where: str) -> str:
    return "in the training forward" if where == "forward" else "outside the forward (backward, loss or optimizer)"


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


class ActivationCheckpointing(Unit):
    reasons = {
        "no_budget": "no memory budget known: give --memory-limit GB (on the CPU), or run on an accelerator",
        "waiting_for_forecast": "waiting for the forecast of the training model's first step",
        "not_forecast": "the step could not be forecast on fake tensors ({why}); nothing changed",
        "fits": "the step's forecast peak {peak} fits the budget {budget}",
        "far_below": "the model's state and batch ({state}) are far below the device's budget {budget}: not forecast",
        "no_blocks": "the step's forecast peak {peak} exceeds the budget {budget}, and {model} has no repeated "
        "blocks (a ModuleList or Sequential of one class) to checkpoint",
        "blocks_held": "the step's forecast peak {peak} exceeds the budget {budget}; {held} holds a layer of "
        "{model}'s blocks",
        "checkpointed": "{count} of {total} blocks of {container} checkpointed: the forecast peak {before} -> {after}, "
        "budget {budget}",
        "still_over": "every block checkpointed, and the forecast peak {after} still exceeds the budget {budget}",
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
    }
    changed_figure = ("blocks_checkpointed", "")
    acts_on = ("<training model>'s repeated blocks: call route, recompute layer (torch.utils.checkpoint)",)

    def apply(self) -> None:
        self._decided = False
        self._recompute_s = 0.0
        self._steps_since = None
        self._model = None  # the training model (weakly), once called
        self._inputs = ()  # the shapes of its first call's positional inputs: the remembered decision's key
        self._held: dict = {}  # block name -> module, checkpointed by this unit
        self._state = out_of_memory.CallState(self.backend.name)
        self._rescued = False
        self._remembered = False  # an out-of-memory error of this run has been remembered for the next
        self._first = self.scope.child()
        self._first.hook(module_hooks.register_forward_pre_hook, self._called)
        self.on_revert(self._forget)
        if self.session.step_memory is None or self.session.step_memory.budget is None:
            self._decided = True
            self.because("no_budget")
            return
        self.because("waiting_for_forecast")
        self.on(Event.MEMORY_FORECAST, self._forecast)

    def _forget(self) -> None:
        self._held.clear()
        self._model = None

    def _called(self, module, args) -> None:
        """The first call with gradients of a module with trainable parameters (not a forecast's
        copy): the training model. Its blocks are checkpointed now where an earlier run ran out of
        memory; its later calls run through the rescue layer."""
        memory = self.session.step_memory
        if not (memory.is_training_call(module) if memory is not None else trains(module)):
            return
        import weakref

        from autogaudi.optimizations.step_profiler import input_shapes

        self._first.close()
        self._model = weakref.ref(module)
        self._inputs = input_shapes(args, {})
        if memory is None or memory.budget is None:  # no memory that could run out: nothing remembered, no layer
            return
        remembered = self.session.memory.recall_memory(module, self._inputs) if self.session.memory else None
        if remembered is not None and not self._held:
            self._recall(module, remembered)
        if compiled_by_the_script(module) or isinstance(module, torch.nn.parallel.DistributedDataParallel):
            self.note("not_rescuable", model=type(module).__name__)
            return
        self.hold(module, Layer.RESCUE, self._rescue)

    def _recall(self, model, remembered: dict) -> None:
        container, names = repeated_blocks(model)
        if not self._checkpoint(model, names):
            return
        self._decided = True
        self.figures.update(checkpointed_from_step=self.session.steps.steps, remembered_on=remembered["date"])
        self.because(
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
            self.hold(modules[name], Layer.RECOMPUTE, self._recompute)
            self._held[name] = modules[name]
        self.figures["blocks_checkpointed"] = list(self._held)
        if self._steps_since is None:
            self._steps_since = self.session.steps.steps
            self.on(Event.TRAINING_STEP, self._step_ended)
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
            self._state.learn(model)
            return result
        # Outside the except clause. The guard keeps the error until all of this is done (where any of
        # it raises, the user gets the error as plain PyTorch's), then lets it go with the forward's
        # tensors its traceback holds, before the memory is freed.
        self._rescued = True
        buffers = self._state.put_back(model)
        container, names = repeated_blocks(model)
        step = self.session.steps.steps
        self._remember("forward", step)
        self.figures["rescued_at_step"] = step
        self.because(
            "rescued",
            step=step,
            buffers=buffers,
            count=len(names),
            total=len(names),
            container=container or type(model).__name__,
        )
        self.moment("rescued", at_step=step)
        call.raised = None
        out_of_memory.release()
        return call(*args, **kwargs)  # where it runs out of memory again, that propagates as plain's

    def _rescuable(self, model) -> bool:
        """Whether every block could be checkpointed (then it is); the error propagates where not."""
        _, names = repeated_blocks(model)
        if self._checkpoint(model, names):
            return True
        self._remember("forward", self.session.steps.steps)
        return False

    def run_ending(self, error) -> None:
        """The run ends with ``error`` raised through the script (None: it did not): an out-of-memory
        one is remembered for the next run."""
        model = self._model() if self._model is not None else None
        if model is None or error is None or not out_of_memory.is_out_of_memory(error):
            return
        step = self.session.steps.steps
        where = "forward" if self._remembered else "outside_forward"
        self.note("not_rescued", where=_where(where), step=step)
        if not self._remembered:
            self._remember(where, step)

    def _remember(self, where: str, step: int) -> None:
        self._remembered = True
        model = self._model()
        container, names = repeated_blocks(model)
        sizes = {"count": len(names), "total": len(names), "container": container or type(model).__name__}
        if not names:
            next_run = self.reason_for("next_run_no_blocks", model=type(model).__name__)
        elif self.session.memory is None:
            next_run = self.reason_for("next_run_no_cache", **sizes)
        else:
            decision = {"blocks": list(names), "where": where, "step": step}
            self.session.memory.remember_memory(model, self._inputs, decision)
            next_run = self.reason_for("next_run", **sizes)
        self.figures["next_run"] = {"code": next_run.code, "what": next_run.text}

    def decision(self) -> Status:
        return Status.NOT_NEEDED if self._decided else Status.WATCHING

    def _forecast(self, model, args, memory) -> None:
        self._decided = True
        forecast, budget = memory.forecast, memory.budget
        if memory.state == "far_below":
            self.because("far_below", state=_mb(memory.state_bytes), budget=_mb(budget))
            return
        if forecast is None:
            self.because("not_forecast", why=memory.why_not)
            return
        sizes = {"peak": _mb(forecast.peak), "budget": _mb(budget)}
        if forecast.peak <= budget:
            self.because("fits", **sizes)
            return
        container, names = repeated_blocks(model)
        if not names:
            self.because("no_blocks", model=type(model).__name__, **sizes)
            return
        modules = dict(model.named_modules())
        held = [route_of(modules[name]) for name in names if route_of(modules[name]) is not None]
        if held:
            owner = next(iter(held[0].layers.values()))[0]
            self.because(
                "blocks_held", held=getattr(owner, "name", type(owner).__name__), model=type(model).__name__, **sizes
            )
            return
        count, chosen = self._fewest(model, args, memory, names)
        self._checkpoint(model, names[:count])
        self.figures.update(
            forecast_peak_bytes_plain=forecast.peak,
            forecast_peak_bytes=chosen.peak,
            budget_bytes=budget,
        )
        memory.forecast = chosen
        after = {"before": _mb(forecast.peak), "after": _mb(chosen.peak), "budget": _mb(budget)}
        self.because(
            "checkpointed", count=count, total=len(names), container=container or type(model).__name__, **after
        )
        if chosen.peak > budget:
            self.note("still_over", **after)
        self.moment("checkpointed", blocks=count)

    def _fewest(self, model, args, memory, names) -> tuple:
        """The fewest leading blocks whose checkpointing brings the forecast under the budget, and that
        forecast: a first guess from what each block keeps alive (a forecast watching them), then
        forecasts of that many blocks checkpointed, one more each time the peak is still over."""
        watched = memory.again(model, args, watch=names)
        over = watched.peak - memory.budget
        count, freed = 0, 0
        for name in names:
            if freed >= over:
                break
            freed += max(0, watched.kept.get(name, 0) - watched.output.get(name, 0))
            count += 1
        count = max(1, count)
        while True:
            chosen = memory.again(model, args, checkpointed=names[:count])
            if chosen.peak <= memory.budget or count == len(names):
                return count, chosen
            count += 1

    def _recompute(self, call, args, kwargs):
        if not torch.is_grad_enabled():
            return call(*args, **kwargs)
        return checkpoint(self._timed(call), *args, use_reentrant=False, **kwargs)

    def _timed(self, call):
        """``call``, its recomputation in backward timed: what checkpointing costs per step. The
        recomputation calls the block itself, not the guard's record of the user's call: torch stops
        it early with an exception that the record would keep, and with it the recomputed tensors."""

        def run(*args, **kwargs):
            if torch._C._current_graph_task_id() == -1:  # the forward itself
                return call(*args, **kwargs)
            start = clock()
            try:
                return call.wrapped(*args, **kwargs)
            finally:
                self._recompute_s += clock() - start

        return run

    def _step_ended(self, _optimizer) -> None:
        steps = self.session.steps.steps - self._steps_since
        if steps > 0:
            self.figures["recompute_ms_per_step"] = round(self._recompute_s * 1000 / steps, 3)

    def changes(self) -> list:
        blocks = self.figures.get("blocks_checkpointed")
        if not blocks:
            return []
        cost = self.figures.get("recompute_ms_per_step")
        cost = f"; recomputing them costs {cost} ms per step" if cost is not None else ""
        if "forecast_peak_bytes" not in self.figures:  # rescued or remembered: the reason says why
            return [f"{len(blocks)} block(s) checkpointed ({', '.join(blocks)}): {self.reason.text}{cost}"]
        measured = self.session.step_memory.measured
        peak = f", measured {_mb(measured[0])}" if measured else ""
        return [
            f"{len(blocks)} block(s) checkpointed ({', '.join(blocks)}): forecast peak "
            f"{_mb(self.figures['forecast_peak_bytes_plain'])} -> {_mb(self.figures['forecast_peak_bytes'])}{peak}, "
            f"budget {_mb(self.figures['budget_bytes'])}{cost}"
        ]
