"""One call path per model, owned by the core: the only way a unit touches how a model is called.

Why: a unit that changes a model's call (its inputs' memory format, the precision its forward runs
in, a captured graph instead of eager ops) used to hang hooks or wrappers on the user's model, and
those travelled with it: ``torch.save(model)``, ``pickle`` and ``copy.deepcopy`` pickled autogaudi's
closures and bound methods, failed, and left half-written checkpoints. Here every change is a
*layer* of one :class:`Route` that sits in ``nn.Module``'s compiled-call slot (the slot
``Module.compile()`` uses), which torch's ``Module.__getstate__`` drops: a saved, pickled or copied
model is a plain one, runs without autogaudi and keeps none of its objects alive. The route calls
the module's own ``_call_impl`` innermost, so the script's hooks run as they always do.

The route is also the session's record of *claims*: which unit holds which layer of which model
(a model that is captured is not also put in channels_last), instead of units asking each other.
Each layer runs through the core's guard (:mod:`autogaudi.core.guard`): a layer whose own code raises is
switched off with its unit, and the call completes as without it.
"""

from __future__ import annotations

import enum
import sys
import weakref

import torch

from autogaudi.core.guard import guarded_call
from autogaudi.core.reasons import Reason


class Layer(enum.IntEnum):
    """Where a unit's layer sits in the call, outermost first."""

    RESCUE = -3  # runs a forward again, checkpointed, after it ran out of memory (activation_checkpointing)
    TRACK = -2  # runs one call inside a memory tracker (autogaudi.measure.step_memory): sees everything the call does
    MEASURE = -1  # sees one call as the script made it, to measure a unit's numerics on a copy (thread cut)
    OBSERVE = 0  # sees the call as the script made it (the precision guard)
    INPUTS = 1  # changes the inputs (memory format)
    PRECISION = 2  # the forward's numeric precision (autocast)
    CAPTURE = 3  # runs the call as a captured graph instead of eagerly
    RECOMPUTE = 4  # a block's call checkpointed: its forward runs again in backward (innermost)


class Route:
    """What ``model(...)`` calls while any unit holds a layer of it: the layers, outermost first,
    around the module's own ``_call_impl``. Holds the model weakly: nothing keeps it alive."""

    def __init__(self, model):
        self._model = weakref.ref(model)
        self.layers: dict = {}  # Layer -> (owner, around)
        self._innermost_first: tuple = ()  # the layers' (owner, around), sorted once per change

    def set(self, layer: Layer, entry) -> None:
        self.layers[layer] = entry
        self._sort()

    def drop(self, layer: Layer, entry) -> None:
        if self.layers.get(layer) is entry:
            del self.layers[layer]
            self._sort()

    def _sort(self) -> None:
        self._innermost_first = tuple(self.layers[key] for key in sorted(self.layers, reverse=True))

    def __call__(self, *args, **kwargs):
        call = self._model()._call_impl
        for owner, around in self._innermost_first:
            call = _layered(owner, around, call)
        return call(*args, **kwargs)

    def __reduce__(self):  # never pickled with a model (torch drops the slot); refuse anything else
        raise TypeError("autogaudi's call route is not picklable")


def _layered(owner, around, inner):
    def call(*args, **kwargs):
        return guarded_call(owner, around, inner, args, kwargs)

    return call


def route_of(model):
    """The model's route, or None where no unit holds a layer of it."""
    slot = vars(model).get("_compiled_call_impl")
    return slot if isinstance(slot, Route) else None


def holder(model, layer: Layer):
    """The owner holding ``layer`` of ``model``, or None."""
    route = route_of(model)
    held = route.layers.get(layer) if route is not None else None
    return held[0] if held is not None else None


def hold(owner, model, layer: Layer, around):
    """Put ``around(call, args, kwargs)`` in ``model``'s call as ``layer``, held by ``owner``; return
    the undo. ``call(*args, **kwargs)`` is the rest of the call; ``around`` returns its output."""
    route = route_of(model)
    if route is None:
        slot = vars(model).get("_compiled_call_impl")
        if slot is not None:  # the script's own model.compile(): never replaced
            raise RuntimeError(f"{type(model).__name__}'s compiled-call slot is the script's")
        route = Route(model)
        model._compiled_call_impl = route
    if layer in route.layers:
        raise RuntimeError(f"{layer.name} of {type(model).__name__} is held already")
    entry = (owner, around)
    route.set(layer, entry)

    def undo():
        route.drop(layer, entry)
        if vars(model).get("_compiled_call_impl") is not route:
            return Reason("call_slot_replaced", model=type(model).__name__)
        if not route.layers:
            del model._compiled_call_impl
        return None

    return undo


def trains(module) -> bool:
    """Whether a call of ``module`` now may be a training step's: gradients on and trainable parameters."""
    return torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters())


def compiled_by_the_script(module) -> bool:
    """Whether the script compiled ``module`` or a submodule itself: ``torch.compile(model)`` (an
    ``OptimizedModule``) or ``model.compile()`` (the compiled-call slot, holding anything but a
    route). No dynamo imported means nothing was compiled."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    for sub in module.modules():
        if dynamo is not None and isinstance(sub, dynamo.OptimizedModule):
            return True
        slot = getattr(sub, "_compiled_call_impl", None)
        if slot is not None and not isinstance(slot, Route):
            return True
    return False
