"""A training step on fake tensors: the doctor's memory projection of a step at other batch sizes.

Why here: the doctor runs the script to observe it and may run its forward again on a fake copy of
the model (no device memory touched, torch's random generators forked); a run under autogaudi
never does, since the copy runs the script's Python where the script can see it (its prints, its
hooks, its Python random draws). The tracker and the parts are :mod:`autogaudi.measure.step_memory`'s.
"""

from __future__ import annotations

import copy
import gc
import types

import torch

from autogaudi.measure import step_memory


def optimizer_of(model):
    """The optimizer holding most of ``model``'s parameters, or None. Found once, at the training
    model's first call, among the live objects: an optimizer is made before it steps, and no hook
    sees it made."""
    owned = {id(p) for p in model.parameters()}
    best, best_count = None, 0
    for candidate in gc.get_objects():
        if issubclass(type(candidate), torch.optim.Optimizer):  # type(): some objects warn on __class__
            count = sum(1 for group in candidate.param_groups for p in group["params"] if id(p) in owned)
            if count > best_count:
                best, best_count = candidate, count
    return best


def _loss_of(output):
    """What the fake step backpropagates: a scalar among the outputs (a model that computes its
    loss), else the sum of every floating output that needs a gradient."""
    tensors = [
        t
        for t in step_memory._flat(output)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    scalars = [t for t in tensors if t.dim() == 0]
    if scalars:
        return scalars[-1]
    return sum(t.float().sum() for t in tensors) if tensors else None


def _fake_optimizer(optimizer, fake_of: dict):
    """The same optimizer class over the fake parameters, its groups' settings and state as the
    original's (state tensors as fakes)."""
    groups = [
        {
            **{key: value for key, value in group.items() if key != "params"},
            "params": [fake_of[id(p)] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    return type(optimizer)(groups)


def predict(model, optimizer, args, kwargs, checkpointed=()) -> step_memory.Forecast:
    """The peak of one training step of ``model`` on fake tensors, for the doctor (which runs the
    script to observe it): a first step to create the optimizer's state, the second tracked.
    ``checkpointed``: names of submodules run under non-reentrant activation checkpointing in the
    copy. The real model, its optimizer and torch's random generators are left as they were; the
    copy runs the model's Python, so a run under autogaudi never calls this."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_of = {}
    for param in model.parameters():
        fake_of[id(param)] = torch.nn.Parameter(mode.from_tensor(param), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        fake_of[id(buffer)] = mode.from_tensor(buffer)
    memo = dict(fake_of)
    shadow = copy.deepcopy(model, memo)  # the route's slot is dropped by Module.__getstate__
    fake_args, fake_kwargs = _fake_inputs(mode, (args, kwargs))
    modules = dict(shadow.named_modules())
    for name in checkpointed:
        _checkpoint_copy(modules[name])
    with torch.random.fork_rng(devices=[]), mode:
        fake_optimizer = _fake_optimizer(optimizer, fake_of) if optimizer is not None else None
        _fake_step(shadow, fake_optimizer, fake_args, fake_kwargs)
        tracker = MemTracker()
        tracker.track_external(shadow, *([fake_optimizer] if fake_optimizer is not None else []))
        with tracker:
            _fake_step(shadow, fake_optimizer, fake_args, fake_kwargs)
    snapshot = tracker.get_tracker_snapshot("peak")
    return step_memory.Forecast(
        step_memory.peak_of(snapshot), step_memory.parts_of(snapshot), checkpointed=checkpointed
    )


def _fake_inputs(mode, value):
    if isinstance(value, torch.Tensor):
        return mode.from_tensor(value)
    if isinstance(value, tuple):
        return tuple(_fake_inputs(mode, item) for item in value)
    if isinstance(value, list):
        return [_fake_inputs(mode, item) for item in value]
    if isinstance(value, dict):
        return {key: _fake_inputs(mode, item) for key, item in value.items()}
    return value


def _fake_step(model, optimizer, args, kwargs) -> None:
    loss = _loss_of(model(*args, **kwargs))
    if loss is None:
        raise ValueError("no output that needs a gradient")
    loss.backward()
    if optimizer is not None:
        _unhooked_step(optimizer)(optimizer)
        optimizer.zero_grad()
    else:
        model.zero_grad()


def _unhooked_step(optimizer):
    """The optimizer class's step below torch's hook-calling wrappers (torch may wrap a class's step
    more than once, and autogaudi's units wrap it too): the session's step watcher would count a
    fake step as the user's."""
    step, below = type(optimizer).step, None
    while step is not None:
        if isinstance(step, types.FunctionType) and step.__dict__.get("hooked"):
            below = step.__wrapped__
        step = getattr(step, "__wrapped__", None)
    if below is None:
        raise TypeError(f"{type(optimizer).__name__}.step has no hook-calling wrapper of torch's")
    return below


def _checkpoint_copy(module) -> None:
    """The copy's ``module`` called through non-reentrant checkpointing, as the real one would be
    (the copy is autogaudi's own: its call slot may be set)."""
    from torch.utils.checkpoint import checkpoint

    call = module._call_impl

    def checkpointed(*args, **kwargs):
        return checkpoint(call, *args, use_reentrant=False, **kwargs)

    module._compiled_call_impl = checkpointed
