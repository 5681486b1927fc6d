"""How far a unit moves the run's numbers from plain PyTorch's, measured on copies: the figure the
report gives beside each applied unit's kind of effect (docs/numerics.md).

Why on copies: the script's tensors, its optimizer's state and its random streams come out of a
measurement as they went in, so a measured run is the run it would have been. A copy that would not
fit in the memory left is not made; the unit then says its effect was not measured.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import random
import sys

import torch
import torch.nn.modules.module
import torch.utils._pytree as pytree

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
        return available_host_bytes()
    stats = backend.memory_stats()
    return None if stats is None else stats.total - stats.allocated


def available_host_bytes() -> int:
    """The machine's available memory: Linux's ``MemAvailable``, read directly (a file read, where
    importing psutil costs a short run's first optimizer step 7-20 ms); psutil's elsewhere."""
    try:
        with open("/proc/meminfo", "rb") as meminfo:
            for line in meminfo:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024  # in KiB
    except (OSError, ValueError, IndexError):
        pass
    import psutil

    return psutil.virtual_memory().available


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
    """Whether every parameter computes as a plain tensor: none dispatches ops its own way (a DTensor,
    whose reductions are collectives; a float8 or quantized subclass). A subclass that only changes
    what Python sees (``__torch_function__``, as a device's tensor type may) computes plainly."""
    return all(
        type(param).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
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


def plain_copy(model):
    """A copy of ``model`` that runs the plain way: autogaudi's call route is not copied (torch's
    ``Module.__getstate__`` drops the compiled-call slot it sits in), and the hooks on its modules
    (the script's logger, a list it fills) stay on the script's own model."""
    shadow = copy.deepcopy(model)
    for module in shadow.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks, module._backward_hooks):
            hooks.clear()
        module._backward_pre_hooks.clear()
    return shadow


def sync_copy(shadow, model) -> None:
    """``shadow`` (a :func:`plain_copy`) with ``model``'s weights and buffers as they are now, and
    each submodule's training flag (a submodule the script froze in eval)."""
    shadow.load_state_dict(model.state_dict())
    for module, real in zip(shadow.modules(), model.modules()):
        module.training = real.training


def float_leaves(output) -> list:
    """The floating-point tensors in a model's output, in a fixed order: tensors, tuples, lists,
    dicts, and dataclasses (a Hugging Face ``ModelOutput``) field by field."""
    found = []
    for leaf in pytree.tree_leaves(output):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += float_leaves([getattr(leaf, field.name) for field in dataclasses.fields(leaf)])
        elif isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            found.append(leaf)
    return found


def random_devices(model, device_type: str) -> list:
    """The indices of the accelerators ``model``'s parameters are on, whose generators a forward may draw from."""
    if device_type in ("", "cpu"):
        return []
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == device_type})


def random_state(devices: list, device_type: str) -> tuple:
    """torch's generators that a forward on ``devices`` draws from: the CPU's, and each device's."""
    module = getattr(torch, device_type, None) if devices else None
    return torch.get_rng_state(), [module.get_rng_state(device) for device in devices]


@contextlib.contextmanager
def forked_random(devices: list, device_type: str, state=None):
    """Every random stream of the script's (torch's CPU and device generators, ``random``, numpy's)
    as it was when the block began, whatever the block draws; inside it, torch's at ``state`` (a
    :func:`random_state`) where given."""
    numpy = sys.modules.get("numpy")
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=devices, device_type=device_type if devices else "cuda"):
            if state is not None:
                torch.set_rng_state(state[0])
                for device, device_state in zip(devices, state[1]):
                    getattr(torch, device_type).set_rng_state(device_state, device)
            yield
    finally:
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


_GLOBAL_MODULE_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


@contextlib.contextmanager
def plain_module_calls():
    """Module calls inside the block run without torch's global module hooks (the step watcher's and
    the step profiler's, which would count a copy's forward as the script's), and without gradients
    set through ``torch._C`` (entering ``torch.no_grad`` is what the step watcher hears as the
    script's evaluation pass)."""
    module = torch.nn.modules.module
    saved = {name: getattr(module, name) for name in _GLOBAL_MODULE_HOOKS}
    grad_before = torch.is_grad_enabled()
    for name, hooks in saved.items():
        setattr(module, name, type(hooks)())
    torch._C._set_grad_enabled(False)
    try:
        yield
    finally:
        torch._C._set_grad_enabled(grad_before)
        for name, hooks in saved.items():
            setattr(module, name, hooks)


def _plain(call, args, kwargs):
    return call(*args, **kwargs)


def active_dropout(model) -> bool:
    """Whether a forward of ``model`` draws dropout masks: a dropout module with p > 0 in training mode."""
    return any(
        isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0 and module.training
        for module in model.modules()
    )


class NotMeasured(Exception):
    """Why :func:`forward_difference` measured nothing: ``code`` ``memory`` (a copy would not fit) or
    ``failed`` (the copy could not be made or run its forward), ``params`` for the note's text."""

    def __init__(self, code: str, **params):
        super().__init__(code)
        self.code, self.params = code, params


def forward_difference(model, args, kwargs, backend, output=None, around=_plain, reference=_plain, state=None):
    """How far a unit's forward moves ``model``'s output on ``args``/``kwargs``: the largest relative
    difference (:func:`largest_relative_difference`, over every floating tensor of the output) of
    ``output`` (the real call's, where given) or else ``around(copy, args, kwargs)`` (the unit's
    variant of the call, run on the copy) against ``reference(copy, args, kwargs)`` (by default the
    plain forward) on a :func:`plain_copy` of it.
    Without gradients, in the model's training mode, torch's generators at ``state`` (a
    :func:`random_state`, taken before the real call) or as they are, for each forward of the copy
    alike; every random stream of the script's comes out as it went in, and the model is not
    touched. Raises :class:`NotMeasured` where a copy would not fit (:func:`copy_fits`) or could not
    run: a measurement is worth less than the unit it measures, and a copy's failure is no failure
    of the user's call."""
    if not copy_fits([*model.parameters(), *model.buffers()], backend):
        raise NotMeasured("memory", share=FREE_SHARE)
    devices = random_devices(model, backend.device_type)

    def forward(call_around):
        with forked_random(devices, backend.device_type, state), plain_module_calls():
            return float_leaves(call_around(shadow, args, kwargs))

    try:
        shadow = plain_copy(model)
        expected = forward(reference)
        if output is None:
            sync_copy(shadow, model)  # the buffers the first forward moved (BatchNorm's running statistics)
            actual = forward(around)
        else:
            actual = float_leaves(output)
        return largest_relative_difference(actual, expected)
    except Exception as error:
        raise NotMeasured("failed", error=f"{type(error).__name__}: {error}") from None


def measured(max_rel_diff: float, of: str, steps: int, against: str) -> dict:
    """A unit's measured effect as its ``numerics_measured`` figure (the report says it): the largest
    relative difference in ``of`` (what was compared) per step over ``steps`` steps, ``against`` what."""
    return {"max_rel_diff": float(f"{max_rel_diff:.3g}"), "of": of, "steps": steps, "against": against}


def bytes_fit(size: int, device: torch.device, backend) -> bool:
    """Whether ``size`` bytes of a measurement's own tensors (not copies: a reference computation's
    results and intermediates) take at most FREE_SHARE of the memory free on ``device``."""
    free = free_bytes(backend, device)
    return free is not None and size <= FREE_SHARE * free
