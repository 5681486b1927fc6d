"""What the observed step needs in memory, and where it fits: the doctor's memory projection.

Why: a script written on one machine is run on another; whether its step fits there, at which
batch, and what would make it fit, is known before the run from the step's forecast on fake
tensors (:func:`autogaudi.measure.fake_step.predict`: no memory touched, no random draw taken). The
forecast is made at the observed batch and at twice it: the difference is what one more sample
adds (its activations), the rest is fixed (parameters, gradients, optimizer state), so the largest
batch that fits each device follows, with and without every repeated block checkpointed. The
levers beyond checkpointing change the experiment (the batch, the optimizer) and are advice only.
"""

from __future__ import annotations

import contextlib
import io
import os

import torch

from autogaudi.measure import fake_step, step_memory
from autogaudi.optimizations.activation_checkpointing import repeated_blocks

GB = 10**9  # vendors' capacities are decimal
# Named devices and their memory; the machine's own comes on top (tests may replace this table).
DEVICES = {"Gaudi2": 96 * GB, "Gaudi3": 128 * GB, "H100": 80 * GB}
EIGHT_BIT_SHARE = 0.75  # an 8-bit AdamW (bitsandbytes) keeps its two moments in a byte each, not four
# The largest batch the projection names: beyond it a line through two forecasts a batch apart says
# nothing a user can act on (a tiny model's bytes a sample give batches of billions), so "at least" it.
MOST_BATCH = 1_000_000


def machine_memory():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _batch_of(args):
    sizes = {value.shape[0] for value in args if isinstance(value, torch.Tensor) and value.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _doubled(args):
    return tuple(
        torch.cat([value, value]) if isinstance(value, torch.Tensor) and value.dim() else value for value in args
    )


def _largest(capacity, fixed, per_sample):
    usable = capacity * step_memory.CAPACITY_SHARE - fixed
    if usable < per_sample:
        return 0
    return min(int(usable // per_sample), MOST_BATCH) if per_sample > 0 else None  # None: nothing grows with it


def _optimizer_of(model, optimizers):
    owned = {id(p) for p in model.parameters()}
    counts = [(sum(id(p) in owned for g in o.param_groups for p in g["params"]), o) for o in optimizers]
    best = max(counts, key=lambda item: item[0], default=(0, None))
    return best[1] if best[0] else None


def projection(model, args, optimizers=()):
    """The memory projection of ``model``'s step called with ``args`` (positional), or None where it
    cannot be forecast (``optimizers``: those seen stepping, the one over the model's parameters
    included in the step): the peak at the observed batch, what a sample adds, with and without every
    block checkpointed, and per device the largest batch that fits."""
    batch = _batch_of(args)
    if batch is None:
        return None
    optimizer = _optimizer_of(model, optimizers) or fake_step.optimizer_of(model)
    _, blocks = repeated_blocks(model)
    # The forecast runs the script's forward again, on fake tensors, after the script: what it prints
    # there is not the script's output.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        plain = [fake_step.predict(model, optimizer, scaled, {}) for scaled in (args, _doubled(args))]
        checkpointed = (
            [fake_step.predict(model, optimizer, scaled, {}, checkpointed=blocks) for scaled in (args, _doubled(args))]
            if blocks
            else None
        )

    def line(pair):
        per_sample = max(0.0, (pair[1].peak - pair[0].peak) / batch)
        return pair[0].peak, per_sample, pair[0].peak - per_sample * batch

    peak, per_sample, fixed = line(plain)
    devices = {**DEVICES, **({"this machine": machine_memory()} if machine_memory() else {})}
    result = {
        "batch": batch,
        "peak_bytes": peak,
        "per_sample_bytes": round(per_sample),
        "parts": plain[0].parts,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "blocks": len(blocks),
        "devices": {},
    }
    if checkpointed:
        result["checkpointed_peak_bytes"], ck_per_sample, ck_fixed = line(checkpointed)
    for name, capacity in devices.items():
        row = {"capacity_bytes": capacity, "fits": peak <= capacity * step_memory.CAPACITY_SHARE}
        row["largest_batch"] = _largest(capacity, fixed, per_sample)
        if checkpointed:
            row["largest_batch_checkpointed"] = _largest(capacity, ck_fixed, ck_per_sample)
        result["devices"][name] = row
    state = plain[0].parts["optimizer_state"]
    result["eight_bit_optimizer_saves_bytes"] = round(state * EIGHT_BIT_SHARE) if optimizer is not None else 0
    return result
