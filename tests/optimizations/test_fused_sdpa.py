"""fused_sdpa against the HPU double: FusedSDPA for the calls it computes exactly (also from
nn.TransformerEncoderLayer), torch's op for the rest, and identical outputs either way."""

import pytest
import torch
import torch.nn.functional as F

import autogaudi


@pytest.fixture
def calls(hpu_double):
    calls = hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="fused_sdpa", sdpa_recompute="on")
    calls.reset()
    return calls


def qkv(*shape, dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=generator, dtype=dtype) for _ in range(3)]


def test_fused_for_4d_inputs_with_recompute_option(calls):
    q, k, v = qkv(2, 4, 8, 16)
    reference = F.scaled_dot_product_attention.__wrapped__(q, k, v, is_causal=True)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True), reference)
    assert calls.CALLS == [("FusedSDPA.apply", {"is_causal": True, "softmax_mode": "None", "recompute_mode": True})]


def test_reaches_transformer_layers_and_keeps_their_numerics(calls):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, dropout=0.0, batch_first=True)
    inputs = torch.randn(2, 5, 16)
    autogaudi.disable()
    expected = layer(inputs)
    autogaudi.enable(device="hpu", only="fused_sdpa", sdpa_recompute="on")
    calls.reset()
    output = layer(inputs)
    output.sum().backward()  # gradients flow through the fused path
    torch.testing.assert_close(output, expected)
    assert calls.names() == ["FusedSDPA.apply"]


@pytest.mark.parametrize(
    "make_call, reason",
    [
        (lambda: qkv(2, 8, 16), "3-D inputs"),
        (lambda: qkv(2, 4, 8, 16, dtype=torch.float64), "dtype torch.float64"),
        (lambda: [qkv(2, 4, 8, 16)[0], *qkv(1, 4, 8, 16)[1:]], "batch broadcasting"),
    ],
)
def test_calls_it_cannot_serve_run_torchs_op(calls, make_call, reason):
    q, k, v = make_call()
    reference = F.scaled_dot_product_attention.__wrapped__(q, k, v)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), reference)
    assert calls.names() == []
    assert autogaudi.report().unit("fused_sdpa")["figures"]["torch_calls_by_reason"] == {reason: 1}


def test_enable_gqa_runs_torchs_op(calls):
    q = qkv(1, 4, 8, 16)[0]
    k, v = qkv(1, 2, 8, 16)[1:]
    reference = F.scaled_dot_product_attention.__wrapped__(q, k, v, enable_gqa=True)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, enable_gqa=True), reference)
    assert calls.names() == []


def test_failure_at_run_time_falls_back(calls, monkeypatch):
    from habana_frameworks.torch.hpex import kernels

    original = F.scaled_dot_product_attention.__wrapped__
    monkeypatch.setattr(kernels.FusedSDPA, "apply", staticmethod(lambda *args: 1 / 0))
    q, k, v = qkv(2, 4, 8, 16)
    reference = F.scaled_dot_product_attention.__wrapped__(q, k, v)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), reference)
    assert autogaudi.report().unit("fused_sdpa")["status"] == "failed"
    assert F.scaled_dot_product_attention is original  # reverted


def test_user_errors_are_torchs_own(calls):
    q, k, v = qkv(2, 4, 8, 16)
    with pytest.raises(RuntimeError) as plain:
        F.scaled_dot_product_attention.__wrapped__(q, k[:, :, :, :3], v)
    with pytest.raises(RuntimeError) as patched:
        F.scaled_dot_product_attention(q, k[:, :, :, :3], v)
    assert str(patched.value) == str(plain.value)
