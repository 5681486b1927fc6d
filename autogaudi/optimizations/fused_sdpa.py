"""HPU: ``scaled_dot_product_attention`` through hpex ``FusedSDPA``.

Why: on Gaudi, torch's op is decomposed into matmuls and a softmax; ``FusedSDPA`` is the Gaudi
flash-attention kernel (less memory traffic, optional recomputation in backward to save memory).
``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` call the op through
``torch.nn.functional``, so they are reached too.
Routed only when FusedSDPA computes the same thing: 4-D float32/bfloat16 inputs, the same batch
size for query, key, value and mask (it does not broadcast the batch), and no ``enable_gqa``.
Any other call runs torch's op, counted by reason. ``--sdpa-recompute on|off`` sets FusedSDPA's
recompute mode; ``auto`` leaves the bridge's default.
CUDA and CPU: skipped, torch already dispatches this op to its fused kernels there.
Measured (``numerics_measured``): at the first fused call without dropout, torch's op on the same
inputs (under no_grad, nothing written) against the fused output: the kernel's rounding. A call with
dropout is not compared: FusedSDPA draws its masks from its own stream, and torch's op would draw
other masks from the script's generator, moving it; so the first call without dropout is measured
(an evaluation pass, or a model without attention dropout), and until one comes the row notes
``dropout_not_compared``. Where torch's attention matrices would not fit in the memory free, it is
not measured (``rounding_not_measured_memory``).
"""

from __future__ import annotations

import torch
import torch.nn.functional

from autogaudi.core.unit import RANDOM, ROUNDING, Unit, UnitSpec
from autogaudi.measure import numerics

_RECOMPUTE = {"auto": None, "on": True, "off": False}
_FUSED_DTYPES = (torch.float32, torch.bfloat16)
# The op is a builtin without an introspectable signature; this is its documented one.
_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def fallback_reason(call: dict):
    """Why FusedSDPA cannot serve this call exactly, or None when it can."""
    query, key, value, mask = call["query"], call["key"], call["value"], call.get("attn_mask")
    if call.get("enable_gqa"):
        return "enable_gqa"
    if query.dim() != 4:
        return f"{query.dim()}-D inputs"
    if query.dtype not in _FUSED_DTYPES:
        return f"dtype {query.dtype}"
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        return "batch broadcasting"
    if mask is not None and mask.dim() == 4 and mask.shape[0] != query.shape[0]:
        return "mask broadcast over the batch"
    return None


def reference_bytes(call: dict) -> int:
    """What torch's op takes beside its inputs where it decomposes (Gaudi): the attention scores
    and their softmax, batch x heads x queries x keys each, and the output."""
    query, key = call["query"], call["key"]
    scores = query.shape[:-1].numel() * key.shape[-2]
    return (2 * scores + query.numel()) * query.element_size()


class FusedSdpa(Unit):
    spec = UnitSpec(
        # Another attention kernel (measured without dropout); with dropout_p, masks of FusedSDPA's own
        numerics=(ROUNDING, RANDOM),
        reasons={
            "hpex": "hpex FusedSDPA, recompute {recompute}",
            # notes: why the kernel's rounding is not measured (yet)
            "dropout_not_compared": "calls with dropout not compared with torch's op: FusedSDPA draws its own masks, "
            "torch's op would draw from the script's generator; measured at the first call without dropout",
            "rounding_not_measured_memory": "rounding not measured: torch's op on the same inputs would take "
            "{gb:.2f} GB, more than {share:.0%} of the memory free",
        },
        changed_figure=("fused_calls", "{} attention calls through FusedSDPA"),
        targets=("torch.nn.functional.scaled_dot_product_attention",),
        acts_for_device=True,
    )

    def apply(self) -> None:
        self._fused = self.run.backend.fused_sdpa()
        self._recompute = _RECOMPUTE[self.run.options.sdpa_recompute]
        self.report.figures.update(fused_calls=0, torch_calls=0, torch_calls_by_reason={})
        self._measuring = True  # until a call without dropout is measured, or cannot be
        self.scope.wrap(torch.nn.functional, "scaled_dot_product_attention", self._attention)
        self.report.because("hpex", recompute=self.run.options.sdpa_recompute)

    def _attention(self, wrapped, instance, args, kwargs):
        call = {**dict(zip(_PARAMETERS, args)), **kwargs}
        reason = fallback_reason(call)
        if reason is not None:
            self.report.figures["torch_calls"] += 1
            by_reason = self.report.figures["torch_calls_by_reason"]
            by_reason[reason] = by_reason.get(reason, 0) + 1
            return wrapped(*args, **kwargs)
        output = self._fused.apply(
            call["query"],
            call["key"],
            call["value"],
            call.get("attn_mask"),
            call.get("dropout_p", 0.0),
            call.get("is_causal", False),
            call.get("scale"),
            "None",
            self._recompute,
        )
        self.report.figures["fused_calls"] += 1
        if self._measuring:
            self._rounding_measured(wrapped, args, kwargs, call, output)
        return output

    def _rounding_measured(self, wrapped, args, kwargs, call, output) -> None:
        """The fused ``output`` against torch's op on the same inputs, at a call without dropout."""
        if call.get("dropout_p", 0.0) > 0:
            self.report.note("dropout_not_compared")
            return
        self._measuring = False
        size = reference_bytes(call)
        if not numerics.bytes_fit(size, call["query"].device, self.run.backend):
            self.report.note("rounding_not_measured_memory", gb=size / 1024**3, share=numerics.FREE_SHARE)
            return
        with torch.no_grad():
            reference = wrapped(*args, **kwargs)
        self.report.figures["numerics_measured"] = numerics.measured(
            numerics.largest_relative_difference([output], [reference]),
            of="attention output",
            steps=1,
            against="torch's scaled_dot_product_attention on the same inputs, without dropout",
        )
