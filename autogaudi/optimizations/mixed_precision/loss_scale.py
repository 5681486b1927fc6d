"""fp16 loss scaling the script does not see: the loss's gradient scaled before backward, the
parameters' gradients unscaled and checked for Inf/NaN before the optimizer step, which is skipped
on an overflow, and the scale grown or halved as ``torch.amp.GradScaler`` does."""

from __future__ import annotations

import collections
import collections.abc

import torch

from autogaudi.core.events import Event

# fp16 loss scaling, torch.amp.GradScaler's defaults: the first scale, clean optimizer steps before it
# doubles (it halves on an overflow); and when fp16 gives up: optimizer steps skipped in a row
INIT_SCALE, GROWTH_INTERVAL, SKIPS_IN_A_ROW = 2.0**16, 2000, 8


def _grads_by_device(parameters) -> dict:
    """The dense gradients of ``parameters``, grouped by device (torch's foreach kernels take one)."""
    grouped = collections.defaultdict(list)
    for parameter in parameters:
        grad = parameter.grad
        if grad is not None and not grad.is_sparse:
            grouped[grad.device].append(grad)
    return grouped


def _closure_step(args, kwargs) -> bool:
    """Whether an optimizer step was given a closure (torch's step hooks see ``args`` with the
    optimizer first)."""
    return len(args) > 1 and args[1] is not None or kwargs.get("closure") is not None


def scale_gradients(grouped: dict, scale: torch.Tensor) -> None:
    """Multiply gradients (grouped by device, :func:`_grads_by_device`) by ``scale`` in place: those
    that earlier backward passes left, before a scaled one accumulates into them."""
    for device, grads in grouped.items():
        torch._foreach_mul_(grads, scale.to(device))


def unscale_gradients(grouped: dict, scale: torch.Tensor) -> None:
    """Divide gradients (grouped by device) by ``scale`` in place, with GradScaler's kernel; exact
    where the scale is a power of two."""
    inverse = scale.double().reciprocal().float()
    for device, grads in grouped.items():
        found = torch.zeros((), device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inverse.to(device))


def non_finite(grouped: dict, device) -> torch.Tensor:
    """1.0 where any of the gradients (grouped by device) holds an inf or NaN, else 0.0: a tensor on
    ``device``, so that checking costs no host read of its own."""
    found = torch.zeros((), device=device)
    one = torch.ones((), device=device)
    for grads_device, grads in grouped.items():
        found_here = torch.zeros((), device=grads_device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_here, one.to(grads_device))
        found += found_here.to(device)
    return found


def update_scale(scale: torch.Tensor, growth_tracker: torch.Tensor, found: torch.Tensor, interval: int) -> None:
    """GradScaler's rule, in place on the device: the scale halves where ``found`` (an overflow),
    and doubles after ``interval`` clean steps in a row (``growth_tracker`` counts them)."""
    torch._amp_update_scale_(scale, growth_tracker, found, 2.0, 0.5, interval)


class LossScale:
    """fp16's dynamic loss scaling, by ``torch.amp.GradScaler``'s rule and with its kernels, around
    the script's own backward passes, so that ``.grad`` holds true gradients whenever the script can
    look (its clipping, gradient logging and accumulation see what a float32 run would):

    - before a backward: a hook on each backpropagated tensor multiplies the gradient entering the
      graph by the scale, and gradients left by earlier backward passes (accumulation) are multiplied
      by it too; after: every gradient is divided by it. Exact, as the scale is a power of two;
    - before each optimizer step (the step watcher's, from torch's global step hooks): its gradients
      are checked for inf/NaN;
      where found the step is skipped (the gradients are set aside while it runs: torch's optimizers
      leave a parameter without a gradient untouched, its state included, and they are put back
      after) and the scale halves; after ``GROWTH_INTERVAL`` clean steps it doubles. A step given a
      closure (LBFGS) computes its gradients inside and is not skipped.

    ``parameters()``: every parameter whose gradient a scaled backward may write (the training model's
    and the optimizers'); ``active()``: whether fp16 is on; ``gave_up(skipped)``: called after
    ``SKIPS_IN_A_ROW`` skipped steps in a row."""

    def __init__(self, parameters, device, active, gave_up):
        self._parameters = parameters
        self._active = active
        self._gave_up = gave_up
        self.scale = torch.full((), INIT_SCALE, dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
        self._hooks: list = []
        self._scaled: dict = {}  # device -> gradients multiplied before the backward now running
        self._set_aside: list = []  # (parameter, gradient) while a skipped step runs
        self.skipped = 0
        self._skipped_in_a_row = 0

    def before_backward(self, tensors) -> None:
        if not self._active():
            return
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors or ())
        self._scaled = _grads_by_device(self._parameters())
        scale_gradients(self._scaled, self.scale)
        roots = {id(t): t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad}  # each once
        self._hooks = [self._hook(root.register_hook, self._scale_gradient) for root in roots.values()]

    def _scale_gradient(self, grad):
        return (grad * self.scale.to(grad.device)).to(grad.dtype)

    def after_backward(self) -> None:
        if not (self._hooks or self._scaled):
            return
        self._unscale(_grads_by_device(self._parameters()))

    def _unscale(self, grouped: dict) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._scaled = [], {}
        unscale_gradients(grouped, self.scale)

    def before_step(self, optimizer, args, kwargs) -> None:
        if not self._active() or _closure_step(args, kwargs):
            return
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        found = non_finite(_grads_by_device(parameters), self.scale.device)
        update_scale(self.scale, self._growth_tracker, found, GROWTH_INTERVAL)
        if not found.item():
            self._skipped_in_a_row = 0
            return
        self.skipped += 1
        self._skipped_in_a_row += 1
        self._set_aside = [(p, p.grad) for p in parameters if p.grad is not None]
        for parameter, _ in self._set_aside:
            parameter.grad = None

    def after_step(self, _optimizer) -> None:
        self._restore()
        if self._skipped_in_a_row >= SKIPS_IN_A_ROW:
            self._skipped_in_a_row = 0
            self._gave_up(self.skipped)

    def _restore(self) -> None:
        for parameter, grad in self._set_aside:
            parameter.grad = grad
        self._set_aside = []

    def close(self) -> None:
        """Stop without leaving a gradient scaled or set aside (fp16 switched off between a backward's
        start and end, or during a skipped step)."""
        if self._hooks or self._scaled:
            self._unscale(self._scaled)
        self._restore()

    def install(self, scope) -> None:
        """Listen through the unit's ``scope`` to the session's backward passes and optimizer steps until
        it closes (the session's dispatcher, not torch's hook tables: a listener removed while
        torch runs a step's hooks would change the table torch is iterating)."""
        self._hook = scope.hook  # the tensor hooks, through the core's guard
        scope.on(Event.BEFORE_BACKWARD, self.before_backward)
        scope.on(Event.AFTER_BACKWARD, self.after_backward)
        scope.on(Event.BEFORE_OPTIMIZER_STEP, self.before_step)
        scope.on(Event.OPTIMIZER_STEP, self.after_step)
        scope.add(self.close)
