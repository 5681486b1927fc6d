"""FusedSDPA.apply(q, k, v, attn_mask, dropout_p, is_causal, scale, softmax_mode, recompute_mode, ...):
positional arguments only (it is an autograd Function), FP32/BF16 only. Computes with torch's own
attention, captured at import so that a patched torch.nn.functional cannot recurse into it."""

import torch

from habana_frameworks.torch._calls import record

_torch_sdpa = torch.nn.functional.scaled_dot_product_attention


class FusedSDPA:
    @staticmethod
    def apply(
        q,
        k,
        v,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        softmax_mode="None",
        recompute_mode=None,
        valid_sequence_lengths=None,
        padding_side="left",
    ):
        if q.dtype not in (torch.float32, torch.bfloat16):
            raise RuntimeError(f"FusedSDPA supports float32 and bfloat16 only, got {q.dtype}")
        record("FusedSDPA.apply", is_causal=is_causal, softmax_mode=softmax_mode, recompute_mode=recompute_mode)
        return _torch_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
