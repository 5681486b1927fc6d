"""How far a unit moves the run's numbers from plain PyTorch's, measured on copies: the figure the
report gives beside each applied unit's kind of effect (docs/numerics.md).

Why on copies: the script's tensors, its optimizer's state and its random streams come out of a
measurement as they went in, so a measured run is the run it would have been. A copy that would not
fit in the memory left is not made; the unit then says its effect was not measured.
"""

from __future__ import annotations

import collections

import psutil
import torch

# A copy is made only where it takes at most this share of the memory still free on its device.
FREE_SHARE = 0.25


def largest_relative_difference(actual, expected) -> float:
    """The largest elementwise ``|actual - expected|`` over pairs of tensors, each relative to the
    largest magnitude in its ``expected`` tensor (absolute where that tensor is all zeros): a norm-
    wise figure, so values near zero do not blow it up. One host read for all pairs."""
    ratios = []
    for got, wanted in zip(actual, expected, strict=True):
        if wanted.numel() == 0:
            continue
        got, wanted = got.detach().float(), wanted.detach().float()
        scale = wanted.abs().max()
        difference = (got - wanted).abs().max()
        ratios.append(torch.where(scale > 0, difference / scale, difference))
    return float(torch.stack([ratio.cpu() for ratio in ratios]).max()) if ratios else 0.0


def free_bytes(backend, device: torch.device):
    """Bytes still free where ``device``'s tensors live: the machine's available memory for the CPU,
    the backend's figures for an accelerator; None where the backend cannot tell."""
    if device.type == "cpu":
        return psutil.virtual_memory().available
    stats = backend.memory_stats()
    return None if stats is None else stats.total - stats.allocated


def copy_fits(tensors, backend) -> bool:
    """Whether copies of ``tensors`` take at most FREE_SHARE of the memory free on each device."""
    needed = collections.Counter()
    for tensor in tensors:
        needed[tensor.device] += tensor.numel() * tensor.element_size()
    for device, size in needed.items():
        free = free_bytes(backend, device)
        if free is None or size > FREE_SHARE * free:
            return False
    return True


def optimizer_tensors(optimizer) -> list:
    """What a copy of ``optimizer``'s update needs: its parameters, their gradients, their state."""
    found = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            found.append(param)
            if param.grad is not None:
                found.append(param.grad)
            found.extend(value for value in optimizer.state.get(param, {}).values() if torch.is_tensor(value))
    return found


def plain_tensors(optimizer) -> bool:
    """Whether every parameter is a plain tensor (not a DTensor, whose reductions are collectives)."""
    return all(
        type(param) in (torch.Tensor, torch.nn.Parameter)
        for group in optimizer.param_groups
        for param in group["params"]
    )


def _step_on_host(value):
    """A step counter as torch's unfused optimizers keep it: a float32 tensor on the CPU."""
    return torch.tensor(float(value)) if not torch.is_tensor(value) else value.detach().to("cpu", copy=True)


def unfused_update(optimizer, step, steps=None) -> list:
    """The parameters ``step`` (the optimizer class's own step, without torch's hook layer) gives from
    ``optimizer``'s current parameters, gradients and state with the script's own settings (torch's
    default foreach or for-loop kernels), computed on copies: the optimizer and its tensors are left
    as they were. ``steps``: step counts by ``id(param)`` that override the state's (a fused optimizer
    that counts per group)."""
    steps = steps or {}
    groups, state, copies = [], collections.defaultdict(dict), []
    for group in optimizer.param_groups:
        params = []
        for param in group["params"]:
            copy = param.detach().clone()
            copy.grad = None if param.grad is None else param.grad.detach().clone()
            if param in optimizer.state:
                state[copy] = {
                    key: _step_on_host(steps.get(id(param), value))
                    if key == "step"
                    else (value.detach().clone() if torch.is_tensor(value) else value)
                    for key, value in optimizer.state[param].items()
                }
            params.append(copy)
        groups.append({**group, "params": params})
        copies.extend(params)
    real_groups, real_state = optimizer.param_groups, optimizer.state
    optimizer.param_groups, optimizer.state = groups, state
    try:
        with torch.no_grad():
            step(optimizer)
    finally:
        optimizer.param_groups, optimizer.state = real_groups, real_state
    return copies


def parameters(optimizer) -> list:
    return [param for group in optimizer.param_groups for param in group["params"]]


def measured(max_rel_diff: float, of: str, steps: int, against: str) -> dict:
    """A unit's measured effect as its ``numerics_measured`` figure (the report says it): the largest
    relative difference in ``of`` (what was compared) per step over ``steps`` steps, ``against`` what."""
    return {"max_rel_diff": float(f"{max_rel_diff:.3g}"), "of": of, "steps": steps, "against": against}


def bytes_fit(size: int, device: torch.device, backend) -> bool:
    """Whether ``size`` bytes of a measurement's own tensors (not copies: a reference computation's
    results and intermediates) take at most FREE_SHARE of the memory free on ``device``."""
    free = free_bytes(backend, device)
    return free is not None and size <= FREE_SHARE * free
