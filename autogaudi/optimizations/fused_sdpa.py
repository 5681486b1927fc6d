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
"""

from __future__ import annotations

import torch
import torch.nn.functional

from autogaudi.unit import RANDOM, ROUNDING, Unit

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


class FusedSdpa(Unit):
    # Another attention kernel; with dropout_p, masks of FusedSDPA's own (by reading)
    numerics = (ROUNDING, RANDOM)
    reasons = {"hpex": "hpex FusedSDPA, recompute {recompute}"}
    changed_figure = ("fused_calls", "{} attention calls through FusedSDPA")
    targets = ("torch.nn.functional.scaled_dot_product_attention",)
    backends = ("hpu",)
    why_not_elsewhere = "torch already dispatches this op to its fused kernels there"

    def apply(self) -> None:
        self._fused = self.backend.fused_sdpa()
        self._recompute = _RECOMPUTE[self.options.sdpa_recompute]
        self.figures.update(fused_calls=0, torch_calls=0, torch_calls_by_reason={})
        self.wrap(torch.nn.functional, "scaled_dot_product_attention", self._attention)
        self.because("hpex", recompute=self.options.sdpa_recompute)

    def _attention(self, wrapped, instance, args, kwargs):
        call = {**dict(zip(_PARAMETERS, args)), **kwargs}
        reason = fallback_reason(call)
        if reason is not None:
            self.figures["torch_calls"] += 1
            by_reason = self.figures["torch_calls_by_reason"]
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
        self.figures["fused_calls"] += 1
        return output
