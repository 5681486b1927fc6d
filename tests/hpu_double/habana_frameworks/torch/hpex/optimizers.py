"""Gaudi fused optimizers with the bridge's own defaults and quirks, computing on the CPU.

FusedAdamW: eps 1e-6 and weight_decay 0.0 by default (torch.optim.AdamW: 1e-8 and 1e-2), no
amsgrad/maximize/foreach/fused/capturable, ``step`` kept as a Python int in the state, empty param
groups rejected, and a mark_step at the end of every step() in lazy mode.
"""
import math

import torch

from habana_frameworks.torch._calls import record
from habana_frameworks.torch.core import mark_step
from habana_frameworks.torch.utils.internal import is_lazy


class _FusedOptimizer(torch.optim.Optimizer):
    """What both fused optimizers share: empty groups refused, closure, record, lazy-mode mark."""

    def __init__(self, params, defaults):
        super().__init__(params, defaults)
        for group in self.param_groups:
            if not group["params"]:
                raise RuntimeError(f"{type(self).__name__}: a parameter group has no parameters")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        record(f"{type(self).__name__}.step", groups=len(self.param_groups))
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._update(group, param, self.state[param])
        if is_lazy():
            mark_step()
        return loss


class FusedAdamW(_FusedOptimizer):
    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 bias_correction=True, moments_dtype=None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, moments_dtype=moments_dtype)
        super().__init__(params, defaults)

    @staticmethod
    def _update(group, param, state):
        beta1, beta2 = group["betas"]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        state["step"] += 1
        step = state["step"]
        param.mul_(1 - group["lr"] * group["weight_decay"])
        state["exp_avg"].lerp_(param.grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
        correction1 = 1 - beta1 ** step if group["bias_correction"] else 1.0
        correction2 = 1 - beta2 ** step if group["bias_correction"] else 1.0
        denominator = (state["exp_avg_sq"].sqrt() / math.sqrt(correction2)).add_(group["eps"])
        param.addcdiv_(state["exp_avg"], denominator, value=-group["lr"] / correction1)


class FusedSGD(_FusedOptimizer):
    def __init__(self, params, lr, momentum=0, weight_decay=0, dampening=0, nesterov=False):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, dampening=dampening,
                        nesterov=nesterov)
        super().__init__(params, defaults)

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
