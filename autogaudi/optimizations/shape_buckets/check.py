"""The shadow check that padding is harmless for a model: one training call run on a copy of the
model twice, as the script made it and padded up to its bucket, from the same weights and random
state, and the two compared: every output (a loss the model computes included; per-position outputs
cut back) and the parameters' gradient, as one vector, for the same output gradient.

Why a random output gradient and not the script's loss: the check runs before the padded call, so no
loss exists yet. Equal outputs give the script's loss computed from them (its labels unchanged) the
same value; equal gradients for a random direction make equal Jacobians all but certain. Dropout is
off in the copy (its masks are drawn per shape, so they differ whatever the model does); a model
with normalisation layers that keep running statistics stays in training mode otherwise, so a batch
statistic over padded positions shows. The primitives are :mod:`autogaudi.measure.numerics`', those of the
precision guard (:mod:`autogaudi.optimizations.mixed_precision.guard`).
"""

from __future__ import annotations

import torch

from autogaudi.measure import numerics
from autogaudi.optimizations.shape_buckets import padding

# How far the padded call may be from the unpadded one (numerics.largest_relative_difference), by the
# parameters' dtype: summing the same values over a longer row rounds differently.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}


class CheckFailed(Exception):
    """Padding moved the result: ``code`` a reason code, ``params`` its values."""

    def __init__(self, code: str, **params):
        super().__init__(code)
        self.code, self.params = code, params


def tolerance(model) -> float:
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return TOLERANCE.get(dtype, 1e-5)


def _without_dropout(copy) -> None:
    for module in copy.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.eval()
    if not any(isinstance(m, torch.nn.modules.batchnorm._NormBase) for m in copy.modules()):
        copy.eval()  # attention's own dropout (Hugging Face's SDPA call) reads its module's flag


def check(model, call, padded_call, rows: int, length: int, bucket: int, unseen, device_type: str) -> float:
    """The largest relative difference of ``padded_call`` against ``call`` (each ``(args, kwargs)``,
    ``rows`` by ``length`` padded to ``bucket``) on a copy of ``model``; raises
    :class:`CheckFailed` where padding moves an output or a gradient past :func:`tolerance`."""
    copy = numerics.plain_copy(model)
    numerics.sync_copy(copy, model)
    _without_dropout(copy)
    devices = numerics.random_devices(model, device_type)
    state = numerics.random_state(devices, device_type)

    def run(args, kwargs, directions):
        """The copy's output and parameter gradients; ``directions(leaves)`` the output gradient."""
        with numerics.forked_random(devices, device_type, state), numerics.plain_module_calls(), unseen():
            with torch.enable_grad():
                copy.zero_grad(set_to_none=True)
                output = copy(*args, **kwargs)
                leaves = [t for t in numerics.float_leaves(output) if t.requires_grad]
                if leaves:
                    torch.autograd.backward(leaves, directions(leaves))
        return output, [p.grad.detach().clone() for p in copy.parameters() if p.grad is not None]

    generator = torch.Generator().manual_seed(0)
    chosen: list = []

    def random_directions(leaves):
        chosen.extend(torch.randn(t.shape, generator=generator).to(t) for t in leaves)
        return chosen

    def padded_directions(leaves):
        if len(leaves) != len(chosen):
            raise CheckFailed("outputs_reshaped")
        return [_padded(direction, leaf.shape, length, bucket) for direction, leaf in zip(chosen, leaves)]

    reference, reference_grads = run(*call, random_directions)
    candidate, candidate_grads = run(*padded_call, padded_directions)
    candidate = padding.cut_back(candidate, rows, length, bucket)
    expected, actual = numerics.float_leaves(reference), numerics.float_leaves(candidate)
    if [t.shape for t in expected] != [t.shape for t in actual] or len(reference_grads) != len(candidate_grads):
        raise CheckFailed("outputs_reshaped")
    difference = max(
        numerics.largest_relative_difference(actual, expected),
        numerics.largest_relative_difference([_flat(candidate_grads)], [_flat(reference_grads)]),
    )
    if not difference <= tolerance(model):
        raise CheckFailed("padding_moves_result", difference=f"{difference:.2g}", tolerance=tolerance(model))
    return difference


def _flat(grads: list):
    """The gradients as one vector: compared as a whole, as the precision guard compares them (a
    parameter whose gradient is zero in exact arithmetic, a key bias under softmax, holds rounding
    noise only, which no tolerance relative to itself would pass)."""
    return torch.cat([g.reshape(-1).float() for g in grads]) if grads else torch.zeros(1)


def _padded(direction, shape, length: int, bucket: int):
    """The unpadded call's output gradient for a leaf of the padded call's ``shape``: zero at the
    padded positions of a per-position output."""
    if direction.shape == shape:
        return direction
    if direction.dim() < 2 or direction.shape[1] != length or shape[1] != bucket or direction.shape[2:] != shape[2:]:
        raise CheckFailed("outputs_reshaped")
    missing = list(direction.shape)
    missing[1] = bucket - length
    return torch.cat([direction, direction.new_zeros(missing)], dim=1)
