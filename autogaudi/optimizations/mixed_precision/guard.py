"""The guard that a precision passes before it is used: the training forwards shadowed on a copy of
the model, in float32 and in the candidate precision from the same state, and the two steps compared
(outputs, loss change, gradient norm and direction) against ``BOUNDS``."""

from __future__ import annotations

import collections
import collections.abc
import time

import torch

from autogaudi.measure import numerics

# How far the candidate may be from float32 on the same step: relative error of the outputs; loss
# change to first order (sum of dL/dout * output change) relative to the loss; gradient norm ratio;
# cosine between the gradients. bf16 keeps 8 significant bits (relative step 0.4%).
BOUNDS = {"output_error": 0.05, "loss_change": 0.02, "grad_norm_ratio": (0.9, 1.1), "grad_cosine": 0.99}
LOW_PRECISION = (torch.bfloat16, torch.float16)


def to_float32(value):
    """``value`` with its bf16/fp16 tensors as float32, through tuples, lists and mappings (a Hugging
    Face ``ModelOutput`` is updated in place, keeping its type)."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in LOW_PRECISION else value
    if isinstance(value, tuple):
        items = [to_float32(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [to_float32(item) for item in value]
    if isinstance(value, collections.abc.MutableMapping):
        for key in list(value):
            value[key] = to_float32(value[key])
    return value


def _tensors(value) -> list:
    """The tensors in an output, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, collections.abc.Mapping):
        return [t for key in value for t in _tensors(value[key])]
    return []


def autocast_call(call, args, kwargs, device_type: str, dtype):
    """``call(*args, **kwargs)`` under autocast to ``dtype``, its outputs handed back in float32."""
    with torch.autocast(device_type, dtype=dtype):
        output = call(*args, **kwargs)
    return to_float32(output)


def compare(reference, candidate, output_grads, loss: float) -> dict:
    """The guard's figures for one step: ``reference`` and ``candidate`` are (output tensors,
    gradient vector) of the float32 and the candidate run of the same step."""
    (ref_out, ref_grad), (cand_out, cand_grad) = reference, candidate
    ref_flat = torch.cat([t.detach().float().reshape(-1) for t in ref_out])
    cand_flat = torch.cat([t.detach().float().reshape(-1) for t in cand_out])
    grads = torch.cat([g.float().reshape(-1) for g in output_grads])
    ref_norm, cand_norm = ref_grad.norm().item(), cand_grad.norm().item()
    return {
        "output_error": (cand_flat - ref_flat).norm().item() / max(ref_flat.norm().item(), 1e-12),
        "loss_change": abs(torch.dot(grads, cand_flat - ref_flat).item()) / max(abs(loss), 1e-12),
        "grad_norm_ratio": cand_norm / max(ref_norm, 1e-12),
        "grad_cosine": torch.nn.functional.cosine_similarity(ref_grad, cand_grad, dim=0).item(),
    }


def within_bounds(figures: dict) -> list:
    """The figures outside ``BOUNDS`` (names), [] when the step agrees."""
    low, high = BOUNDS["grad_norm_ratio"]
    out = [name for name in ("output_error", "loss_change") if not figures[name] <= BOUNDS[name]]
    if not low <= figures["grad_norm_ratio"] <= high:
        out.append("grad_norm_ratio")
    if not figures["grad_cosine"] >= BOUNDS["grad_cosine"]:
        out.append("grad_cosine")
    return out


class Guard:
    """Shadow runs of the user's training forwards on a copy of the model, once their backward has
    given the gradient of the user's loss at the output. ``scales``: the loss scales the candidate's
    backward tries in turn until its gradients are finite (fp16's loss scaling; (1.0,) elsewhere);
    ``unseen``: the session's context for backward passes that are not the user's."""

    def __init__(self, model, precision_context, reference_context, device_type, scales, unseen):
        self.copy = numerics.plain_copy(model)
        self.model = model
        self.precision_context = precision_context
        self.reference_context = reference_context
        self.scales = scales
        self.unseen = unseen
        # the random generators a dropout in the forward may draw from: the CPU's, and the device's
        self.device_type = device_type
        self.devices = numerics.random_devices(model, device_type)
        self.backward_passes = 0
        self.pending: list = []  # (inputs, random state, output tensors, their gradients) per forward
        self.loss = None
        self.figures: list = []
        self.seconds = 0.0

    def before_forward(self, args, kwargs) -> None:
        detached = (
            [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args],
            {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()},
        )
        self.pending.append([detached, numerics.random_state(self.devices, self.device_type), None, None])

    def after_forward(self, output) -> list:
        """The forward's output tensors, each with the hook that keeps the gradient it gets."""
        record = self.pending[-1]
        outputs = [t for t in _tensors(output) if t.requires_grad and t.is_floating_point()]
        record[2] = outputs
        record[3] = [None] * len(outputs)
        return [(tensor, self._keeper(record, index)) for index, tensor in enumerate(outputs)]

    @staticmethod
    def _keeper(record, index):
        def keep(grad):
            record[3][index] = grad.detach().clone()

        return keep

    def check(self) -> None:
        """After a backward: compare every forward whose outputs the loss reached. An output it did
        not reach (hidden states returned beside the logits) has a zero gradient."""
        started = time.perf_counter()
        self.backward_passes += 1
        done, self.pending = self.pending, []
        for inputs, state, outputs, grads in done:
            if not outputs or all(g is None for g in grads):
                continue
            grads = [torch.zeros_like(o) if g is None else g for g, o in zip(grads, outputs)]
            numerics.sync_copy(self.copy, self.model)
            with self.unseen():
                reference = self._shadow(inputs, state, grads, self.reference_context)
                for scale in self.scales:
                    candidate = self._shadow(inputs, state, grads, self.precision_context, scale)
                    if torch.isfinite(candidate[1]).all():
                        break
            self.figures.append(compare(reference, candidate, grads, self.loss if self.loss is not None else 1.0))
        self.seconds += time.perf_counter() - started

    def _shadow(self, inputs, state, grads, context, scale=1.0):
        args, kwargs = inputs
        with numerics.forked_random(self.devices, self.device_type, state):
            self.copy.zero_grad(set_to_none=True)
            with context():
                output = self.copy(*args, **kwargs)
            outputs = [t for t in _tensors(to_float32(output)) if t.requires_grad and t.is_floating_point()]
            torch.autograd.backward(outputs, [grad * scale for grad in grads])
        params = [p.grad.reshape(-1) / scale for p in self.copy.parameters() if p.grad is not None]
        return outputs, torch.cat(params).float() if params else torch.zeros(1)
