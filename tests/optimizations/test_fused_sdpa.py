"""fused_sdpa against the HPU double: FusedSDPA for the calls it computes exactly (also from
nn.TransformerEncoderLayer), torch's op for the rest, and identical outputs either way."""

import pytest
import torch
import torch.nn.functional as F

import autogaudi
from tests.helpers import said


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


MEASURED_KEYS = {"max_rel_diff", "of", "steps", "against"}


def test_first_call_without_dropout_is_measured_against_torchs_op(calls):
    q, k, v = qkv(2, 4, 8, 16)
    first = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    row = autogaudi.report().unit("fused_sdpa")
    assert set(row["numerics_measured"]) == MEASURED_KEYS and row["numerics_measured"]["max_rel_diff"] == 0.0
    second = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # not measured again
    assert autogaudi.report().unit("fused_sdpa")["numerics_measured"] == row["numerics_measured"]
    assert torch.equal(first, second)  # a measured call's output is an unmeasured one's
    assert calls.names() == ["FusedSDPA.apply"] * 2


def test_calls_with_dropout_are_not_compared_and_draw_nothing_more(calls):
    """torch's op with dropout would move the script's generator: the first call without dropout is
    measured instead."""
    q, k, v = qkv(2, 4, 8, 16)
    torch.manual_seed(3)
    F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    drawn = torch.get_rng_state()
    torch.manual_seed(3)
    autogaudi.disable()
    F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)  # the double draws as torch's op does
    assert torch.equal(torch.get_rng_state(), drawn)
    autogaudi.enable(device="hpu", only="fused_sdpa", sdpa_recompute="on")
    F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    row = autogaudi.report().unit("fused_sdpa")
    assert row["numerics_measured"] is None and [code for code, _ in said(row)] == ["dropout_not_compared"]
    F.scaled_dot_product_attention(q, k, v)
    assert autogaudi.report().unit("fused_sdpa")["numerics_measured"]["steps"] == 1


def test_the_figure_is_the_fused_outputs_distance_from_torchs(calls, monkeypatch):
    from habana_frameworks.torch.hpex import kernels

    apply = kernels.FusedSDPA.apply
    monkeypatch.setattr(kernels.FusedSDPA, "apply", staticmethod(lambda *args: apply(*args) * (1 + 2**-10)))
    F.scaled_dot_product_attention(*qkv(2, 4, 8, 16))
    figure = autogaudi.report().unit("fused_sdpa")["numerics_measured"]
    assert figure["max_rel_diff"] == pytest.approx(2**-10, rel=1e-2)


def test_not_measured_where_torchs_attention_would_not_fit(calls, monkeypatch):
    from autogaudi.measure import numerics

    monkeypatch.setattr(numerics, "FREE_SHARE", 0.0)
    F.scaled_dot_product_attention(*qkv(2, 4, 8, 16))
    row = autogaudi.report().unit("fused_sdpa")
    assert row["numerics_measured"] is None
    assert [code for code, _ in said(row)] == ["rounding_not_measured_memory"]
