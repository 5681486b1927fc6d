"""torch's fused kernels as the unit uses them: which tensors they refuse, ``fused=True`` set for the
time of one group's update, the step counters a raising update advanced put back, and Adam's
per-parameter ``step`` moved between the fused and the unfused formats.

torch refuses some tensors only inside the fused step (sparse gradients, complex or integer
parameters, other devices, DTensors under SGD), after building the optimizer without complaint: they
are checked before each update (after the closure, whose gradients count) and at construction, and
such an optimizer runs torch's own unfused step from then on. If the fused step raises anyway, the
group it raised on (torch checks a group before updating it) and the groups after it run unfused,
its counters put back, and the optimizer stays unfused.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch
from torch.optim.optimizer import _foreach_supported_types, _get_scalar_dtype
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices


def user_hyperparameters(optimizer_class, args, kwargs) -> dict:
    """Every hyperparameter the user's constructor call means, defaults included."""
    bound = inspect.signature(optimizer_class.__init__).bind(None, *args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    for name in ("self", "params"):
        values.pop(name, None)
    return values


def unfusable_tensor(optimizer, dtensor_refused_by=None):
    """``(code, values)`` for the first tensor of ``optimizer`` its fused kernel would refuse at the
    step (torch's own criteria: ``_default_to_fused_or_foreach`` and the kernels' checks), or None."""
    devices = _get_fused_kernels_supported_devices()
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if dtensor is not None and isinstance(param, dtensor):
                if dtensor_refused_by:
                    return "dtensor_parameters", {"kernel": dtensor_refused_by}
            elif type(param) not in _foreach_supported_types:
                return "parameter_type", {"type": type(param).__name__}
            if param.device.type not in devices:
                return "parameter_device", {"device": param.device.type, "devices": "/".join(devices)}
            if not torch.is_floating_point(param):
                return "parameter_dtype", {"dtype": str(param.dtype)}
            if param.grad is not None and param.grad.layout is not torch.strided:
                return "sparse_gradients", {"layout": str(param.grad.layout)}
    return None


@contextlib.contextmanager
def fused_flag(group):
    """``fused=True`` in ``group`` for the time of torch's step, where the script left it unset."""
    if group.get("fused") is not None:
        yield
        return
    group["fused"] = True
    try:
        yield
    finally:
        group["fused"] = None


def step_counters(optimizer, group) -> dict:
    """Adam's ``step`` counter of each of ``group``'s parameters that has one, with its version."""
    counters = {}
    for param in group["params"]:
        step = optimizer.state.get(param, {}).get("step")
        if torch.is_tensor(step):
            counters[id(param)] = (step, step._version)
    return counters


def rewind(optimizer, group, counters) -> None:
    """Put back the counters a fused step that raised had advanced: it counts before its kernel
    runs (and takes one back itself on a step GradScaler skips), the unfused step counts again."""
    for param in group["params"]:
        step = optimizer.state.get(param, {}).get("step")
        if torch.is_tensor(step):
            before, version = counters.get(id(param), (None, 0))  # a counter created in this step: 0
            if step._version != (version if before is step else 0):
                step.sub_(1)


def fused_format_steps(optimizer) -> None:
    """Adam's per-parameter ``step`` where the fused kernel wants it, float32 on the parameter's
    device: torch puts it there when it loads a checkpoint into a fused optimizer, and this one's
    groups say the script's ``fused`` (a plain checkpoint keeps it on the CPU)."""
    for param, state in optimizer.state.items():
        step = state.get("step")
        if torch.is_tensor(step):
            state["step"] = step.to(dtype=torch.float32, device=param.device)


def unfused_format_steps(optimizer) -> None:
    """Adam's per-parameter ``step`` where torch's unfused step keeps it (its ``_init_group``): on the
    CPU unless the group is capturable, in the default float dtype, as a run never fused has it."""
    for group in optimizer.param_groups:
        dtype = _get_scalar_dtype(is_fused=group.get("fused"))
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            step = state.get("step")
            if torch.is_tensor(step):
                state["step"] = step.to(dtype=dtype, device=param.device if group.get("capturable") else "cpu")


def step_group_by_group(optimizer, step, unfuse) -> None:
    """torch's ``step`` with ``fused=True`` set in each group for the time of its update, one group
    at a time: where the kernel refuses a group (torch checks a group's tensors before updating any),
    its counters are put back, ``unfuse(error)`` is called with every group in place, and that group
    and the ones after it run unfused, the groups before it being done."""
    groups = optimizer.param_groups
    try:
        for index, group in enumerate(groups):
            optimizer.param_groups = [group]
            counters = step_counters(optimizer, group)
            try:
                with fused_flag(group):
                    step(optimizer)
            except Exception as error:
                rewind(optimizer, group, counters)
                optimizer.param_groups = groups  # every group's counters to the unfused format
                unfuse(error)
                optimizer.param_groups = groups[index:]
                step(optimizer)  # plain PyTorch's step for the rest: its errors are its own
                return
    finally:
        optimizer.param_groups = groups
