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
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from autogaudi.events import Event
from autogaudi.model_call import Layer, route_of
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


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"


class ActivationCheckpointing(Unit):
    reasons = {
        "no_budget": "no memory budget known: give --memory-limit GB (on the CPU), or run on an accelerator",
        "waiting_for_forecast": "waiting for the forecast of the training model's first step",
        "not_forecast": "the step could not be forecast on fake tensors ({why}); nothing changed",
        "fits": "the step's forecast peak {peak} fits the budget {budget}",
        "no_blocks": "the step's forecast peak {peak} exceeds the budget {budget}, and {model} has no repeated "
        "blocks (a ModuleList or Sequential of one class) to checkpoint",
        "blocks_held": "the step's forecast peak {peak} exceeds the budget {budget}; {held} holds a layer of "
        "{model}'s blocks",
        "checkpointed": "{count} of {total} blocks of {container} checkpointed: the forecast peak {before} -> {after}, "
        "budget {budget}",
        "still_over": "every block checkpointed, and the forecast peak {after} still exceeds the budget {budget}",
    }
    changed_figure = ("blocks_checkpointed", "")
    acts_on = ("<training model>'s repeated blocks: call route, recompute layer (torch.utils.checkpoint)",)

    def apply(self) -> None:
        self._decided = False
        self._recompute_s = 0.0
        self._steps_since = None
        if self.session.step_memory.budget is None:
            self._decided = True
            self.because("no_budget")
            return
        self.because("waiting_for_forecast")
        self.on(Event.MEMORY_FORECAST, self._forecast)

    def watching(self) -> bool:
        return not self._decided

    def _forecast(self, model, args, memory) -> None:
        self._decided = True
        forecast, budget = memory.forecast, memory.budget
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
        for name in names[:count]:
            self.hold(modules[name], Layer.RECOMPUTE, self._recompute)
        self.figures.update(
            blocks_checkpointed=list(names[:count]),
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
        self._steps_since = self.session.steps.steps
        self.on(Event.TRAINING_STEP, self._step_ended)

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
        measured = self.session.step_memory.measured
        peak = f", measured {_mb(measured[0])}" if measured else ""
        cost = self.figures.get("recompute_ms_per_step")
        cost = f"; recomputing them costs {cost} ms per step" if cost is not None else ""
        return [
            f"{len(blocks)} block(s) checkpointed ({', '.join(blocks)}): forecast peak "
            f"{_mb(self.figures['forecast_peak_bytes_plain'])} -> {_mb(self.figures['forecast_peak_bytes'])}{peak}, "
            f"budget {_mb(self.figures['budget_bytes'])}{cost}"
        ]
