"""Gaudi fused optimizers with the bridge's own defaults and quirks, computing on the CPU.

FusedAdamW (bridge ``hpex/optimizers/FusedAdamW.py``, read 2026-11-23): eps 1e-6 and weight_decay
0.0 by default (torch.optim.AdamW: 1e-8 and 1e-2), no amsgrad/maximize/foreach/fused/capturable.
The step counter lives in the param group (``group["step"]``, counted only for a group with a
gradient); each parameter's ``state["step"]`` is set to the int 0 once and never counted. The
kernel's update, from the optimizer's arguments: weights times ``1 - lr * weight_decay``, then
``p -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps)``, eps added to the
un-corrected ``sqrt(v)`` (torch AdamW adds it to the corrected one). In lazy mode a step is marked
before each group and after ``step()``.

FusedSGD (bridge ``hpex/optimizers/FusedSGD.py``, same reading): marks a step at the end of
``__init__`` in lazy mode and none in ``step()``; keeps ``step_t`` (an int32 tensor, handed to the
momentum kernel, whose use of it is not in the Python source and is not modelled), ``lr_t`` and
``lr_list`` on the optimizer object, rebuilding ``lr_t`` from each group's ``lr`` at every step; the
update follows torch's SGD (momentum buffer = the first gradient, then ``m*buf + (1-dampening)*g``).
"""

import math

import torch

from habana_frameworks.torch._calls import record
from habana_frameworks.torch.core import mark_step
from habana_frameworks.torch.utils.internal import is_lazy


class _FusedOptimizer(torch.optim.Optimizer):
    """What both fused optimizers share: empty groups refused."""

    def __init__(self, params, defaults):
        super().__init__(params, defaults)
        for group in self.param_groups:
            if not group["params"]:
                raise RuntimeError(f"{type(self).__name__}: a parameter group has no parameters")


class FusedAdamW(_FusedOptimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0, bias_correction=True):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        record("FusedAdamW.step", groups=len(self.param_groups))
        for group in self.param_groups:
            if is_lazy():
                mark_step()
            params = [param for param in group["params"] if param.grad is not None]
            for param in params:
                state = self.state[param]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
            if not params:
                continue
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            step_size = group["lr"]
            if group["bias_correction"]:
                step_size *= math.sqrt(1 - beta2 ** group["step"]) / (1 - beta1 ** group["step"])
            for param in params:
                state = self.state[param]
                param.mul_(1 - group["weight_decay"] * group["lr"])
                state["exp_avg"].lerp_(param.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
                param.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["eps"]), value=-step_size)
        if is_lazy():
            mark_step()
        return loss


class FusedSGD(_FusedOptimizer):
    def __init__(self, params, lr, momentum=0, weight_decay=0, dampening=0, nesterov=False):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, dampening=dampening, nesterov=nesterov)
        super().__init__(params, defaults)
        self.lr_list = []
        self.lr_t = None
        self.step_t = torch.tensor([0], dtype=torch.int32)
        if is_lazy():
            mark_step()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        record("FusedSGD.step", groups=len(self.param_groups))
        self.lr_list.clear()
        for group in self.param_groups:
            self.lr_t = torch.tensor([group["lr"]], dtype=torch.float)
            self.lr_list.append(self.lr_t)
            for param in group["params"]:
                if param.grad is not None:
                    self._update(group, param, self.state[param])
        return loss

    @staticmethod
    def _update(group, param, state):
        grad = param.grad
        if group["weight_decay"]:
            grad = grad.add(param, alpha=group["weight_decay"])
        if group["momentum"]:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = grad.clone()
            else:
                state["momentum_buffer"].mul_(group["momentum"]).add_(grad, alpha=1 - group["dampening"])
            buffer = state["momentum_buffer"]
            grad = grad.add(buffer, alpha=group["momentum"]) if group["nesterov"] else buffer
        param.add_(grad, alpha=-group["lr"])
