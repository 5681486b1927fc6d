"""The hpex fused optimizers' formats against torch's: hpex keeps ``step`` as a Python int counted
in each group, torch a float32 tensor per parameter. Checkpoints, copies and pickles of a user's
optimizer stepped by hpex are given in torch's format; a loaded one is taken into hpex's.

On HPU the user's ``torch.optim`` object is built as written and keeps every user-visible aspect
(type, ``param_groups``, ``state``, schedulers, ``add_param_group``); its ``step`` runs an hpex
fused optimizer that shares that state and mirrors each of the user's groups in a group of its
own (its extra settings added, empty groups left out), with every hyperparameter passed
explicitly (FusedAdamW's own defaults, eps 1e-6 and weight_decay 0.0, differ from torch's). The
mirrors persist from step to step: the bridge's FusedAdamW counts steps in its group
(``group["step"]``), and a mirror rebuilt each step made every step its first (a constant
learning rate of sqrt(1-beta2)/(1-beta1) times the user's). The user's step hooks fire once.

FusedAdamW is a formula of its own, not a rounding of AdamW's: it adds eps to the un-corrected
``sqrt(v)`` (bridge ``hpex/optimizers/FusedAdamW.py``), i.e. torch's update with eps grown to
``eps / sqrt(1 - beta2^t)`` (31.6x at step 1 with beta2 0.999). One update per element then differs
from torch's by at most ``1 - sqrt(1 - beta2^t)`` relatively (0.968, 0.955, 0.945 at steps 1-3;
reached where gradients are near eps: measured on the HPU double, 1000 gradients of scale 1e-9),
0.15 at step 1 for gradients of scale 1e-3 and 2e-4 for scale 1, shrinking as t grows.
"""

from __future__ import annotations

import collections

import torch


def raw_step(optimizer):
    """The optimizer class's ``step`` without torch's hook layer (``profile_hook_step``)."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step)


def int_steps(optimizer) -> None:
    """The hpex optimizers keep ``step`` as a Python int (torch: a float32 tensor)."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = int(state["step"].item())


def torch_step(step):
    """torch keeps ``step`` as a float32 tensor; the hpex optimizers keep a Python int."""
    return torch.tensor(float(step)) if isinstance(step, int) else step


def saved_step(group, state) -> dict:
    """``{"step": n}`` for a group whose parameters carry a saved step (a loaded checkpoint), else {}."""
    saved = [int(state[param]["step"]) for param in group["params"] if "step" in state.get(param, {})]
    return {"step": max(saved)} if saved and max(saved) > 0 else {}


def torch_format_checkpoint(optimizer, state_dict, steps):
    """Torch's checkpoint format: each parameter's ``step`` a tensor, counted by its group. Copies:
    the per-parameter dicts in ``state_dict()`` are the live state the fused kernel uses."""
    indexed = {
        index: param
        for group, saved in zip(optimizer.param_groups, state_dict["param_groups"])
        for index, param in zip(saved["params"], group["params"])
    }
    group_steps = steps(optimizer)
    state = {
        index: {**values, "step": torch_step(group_steps.get(id(indexed.get(index)), values["step"]))}
        if "step" in values
        else values
        for index, values in state_dict["state"].items()
    }
    return {**state_dict, "state": state}


def group_steps(mirrors) -> dict:
    """The step count of each parameter, from its group's counter (the bridge keeps no other)."""
    return {
        id(param): mirror["step"] for _, mirror in mirrors.values() if "step" in mirror for param in mirror["params"]
    }


def torch_format_state(state, steps) -> dict:
    """``__getstate__``'s ``state`` with each parameter's ``step`` in torch's format, from ``steps``."""
    per_param = {
        param: {**values, "step": torch_step(steps.get(id(param), values["step"]))} if "step" in values else values
        for param, values in state["state"].items()
    }
    return {**state, "state": collections.defaultdict(dict, per_param)}


def mirror_groups(param_groups, state, extra, known) -> dict:
    """``{id(group): (group, mirror)}`` for the hpex optimizer: one mirror per non-empty user group
    (it rejects empty ones), the user's current values (a scheduler's lr) plus hpex's own settings
    (``extra``) and counters, kept across steps from ``known``. A new group (or one ``load_state_dict``
    rebuilt) starts its counter from its parameters' saved steps."""
    mirrors = {}
    for group in param_groups:
        if not group["params"]:
            continue
        kept, mirror = known.get(id(group), (None, None))
        if kept is not group:  # a new group, or one whose id was reused
            mirror = {**extra, **saved_step(group, state)}
        mirror.update(group)
        mirrors[id(group)] = (group, mirror)
    return mirrors


def torch_format_steps(optimizer, steps) -> None:
    """Each parameter's ``step`` in ``optimizer.state`` in torch's format, counted as ``steps`` says."""
    for param, state in optimizer.state.items():
        if "step" in state:
            state["step"] = torch_step(steps.get(id(param), state["step"]))
