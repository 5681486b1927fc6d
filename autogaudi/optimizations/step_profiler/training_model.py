"""Which module the step trains, how often it is called per step, and the shapes it is called with:
what graph capture compiles and a later run is remembered by."""

from __future__ import annotations

import sys

import torch

from autogaudi.watch import module_hooks


def input_shapes(args, kwargs) -> tuple:
    """What a new graph is built for: tensors' shapes, and the values of plain arguments (an int, a
    flag), on which torch.compile specialises and which ModuleCacher keys its graphs by as well."""

    def key(value):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
        return value if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__

    return tuple(key(value) for value in args) + tuple((name, key(value)) for name, value in kwargs.items())


class RootModules:
    """The outermost modules called during a census step (what produced the loss), added to
    ``called``, how often each was called in the step (``calls``, by identity: a module called
    again while an earlier output is still in use cannot replay graphs into static outputs), and the
    shapes of each one's first positional inputs (``inputs``, by identity: part of the key runs are
    remembered by)."""

    def __init__(self, called: list, scope):
        self.depth = 0
        self.called = called
        self.calls: dict = {}
        self.inputs: dict = {}
        scope.hook(module_hooks.register_forward_pre_hook, self._enter)
        scope.hook(module_hooks.register_forward_hook, self._leave)

    def _enter(self, module, args):
        if self.depth == 0:
            if not any(module is seen for seen in self.called):
                self.called.append(module)
            self.calls[id(module)] = self.calls.get(id(module), 0) + 1
            self.inputs.setdefault(id(module), input_shapes(args, {}))
        self.depth += 1

    def _leave(self, _module, _args, _output):
        self.depth = max(0, self.depth - 1)


def training_root(roots: list, optimizer):
    """The root module that owns most of the optimizer's parameters (without an optimizer: of the
    parameters the step gave a gradient), or None."""
    if optimizer is not None:
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    else:
        optimized = {id(p) for module in roots for p in module.parameters() if p.grad is not None}
    best, best_count = None, 0
    for module in roots:
        count = sum(p.numel() for p in module.parameters() if id(p) in optimized)
        if count > best_count:
            best, best_count = module, count
    return best


def model_name(model) -> str:
    """The class of the model the script wrote: a ``torch.compile(model)`` of its own is named by the
    module it compiled. The profile's model stays the ``OptimizedModule``, the module the script calls
    (the units that would compile or hold that call see it compiled by the script)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return type(model).__name__
