"""fused_clip_norm against the HPU double: same total norm and clipped gradients as torch, one
FusedClipNorm per parameter set, and torch's own path for calls FusedClipNorm cannot serve."""

import pytest
import torch

import autogaudi


def grads(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 2))
    model(torch.randn(4, 6)).pow(2).sum().backward()
    return model


# In lazy mode the bridge's clip_norm marks a step before clipping and after.
CLIP = ["mark_step", "FusedClipNorm.clip_norm", "mark_step"]


@pytest.fixture
def calls(hpu_double):
    calls = hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="fused_clip_norm")
    calls.reset()
    return calls


def test_same_norm_and_clipped_gradients_as_torch(calls):
    reference, model = grads(), grads()
    autogaudi.disable()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    autogaudi.enable(device="hpu", only="fused_clip_norm")
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # a generator, as scripts pass it
    torch.testing.assert_close(total, expected)
    for fused, plain in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(fused.grad, plain.grad)
    assert calls.names() == ["FusedClipNorm", *CLIP]


def test_built_once_per_parameter_set_and_max_norm(calls):
    model = grads()
    for _ in range(3):
        torch.nn.utils.clip_grad.clip_grad_norm_(model.parameters(), 1.0)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 2.0)
    assert calls.names() == ["FusedClipNorm", *CLIP * 3, "FusedClipNorm", *CLIP]
    figures = autogaudi.report().unit("fused_clip_norm")["figures"]
    assert (figures["fused_calls"], figures["torch_calls"]) == (4, 0)


MEASURED_KEYS = {"max_rel_diff", "of", "steps", "against"}


def test_first_fused_call_measures_the_norm_against_torchs_and_changes_nothing(calls):
    """Measured at the first call only (no extra bridge calls); a measured call's gradients are an
    unmeasured one's, bit for bit."""
    measured, unmeasured, reference = grads(), grads(), grads()
    autogaudi.disable()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    autogaudi.enable(device="hpu", only="fused_clip_norm")
    calls.reset()
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(measured.parameters(), 0.1), expected)
    figure = autogaudi.report().unit("fused_clip_norm")["numerics_measured"]
    assert set(figure) == MEASURED_KEYS and (figure["max_rel_diff"], figure["steps"]) == (0.0, 1)
    torch.nn.utils.clip_grad_norm_(unmeasured.parameters(), 0.1)
    assert autogaudi.report().unit("fused_clip_norm")["numerics_measured"] == figure  # not measured again
    assert calls.names() == ["FusedClipNorm", *CLIP, "FusedClipNorm", *CLIP]
    for one, other in zip(measured.parameters(), unmeasured.parameters()):
        assert torch.equal(one.grad, other.grad)


def test_the_figure_is_the_fused_norms_distance_from_torchs(calls, monkeypatch):
    from habana_frameworks.torch.hpex import normalization

    clip_norm = normalization.FusedClipNorm.clip_norm
    monkeypatch.setattr(normalization.FusedClipNorm, "clip_norm", lambda self, p: clip_norm(self, p) * (1 + 2**-10))
    torch.nn.utils.clip_grad_norm_(grads().parameters(), 0.1)
    figure = autogaudi.report().unit("fused_clip_norm")["numerics_measured"]
    assert figure["max_rel_diff"] == pytest.approx(2**-10, rel=1e-2)


@pytest.mark.parametrize(
    "kwargs", [{"norm_type": 1.0}, {"norm_type": float("inf")}, {"error_if_nonfinite": True}, {"foreach": False}]
)
def test_calls_it_cannot_serve_run_torchs_own(calls, kwargs):
    reference, model = grads(), grads()
    autogaudi.disable()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, **kwargs)
    autogaudi.enable(device="hpu", only="fused_clip_norm")
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, **kwargs), expected)
    assert calls.names() == []
    assert autogaudi.report().unit("fused_clip_norm")["figures"]["torch_calls"] == 1


def test_failure_at_run_time_falls_back_to_torch(calls, monkeypatch):
    from habana_frameworks.torch.hpex import normalization

    autogaudi.disable()
    original = torch.nn.utils.clip_grad_norm_
    reference, model = grads(), grads()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
    autogaudi.enable(device="hpu", only="fused_clip_norm")
    monkeypatch.setattr(normalization.FusedClipNorm, "clip_norm", lambda self, p: 1 / 0)
    torch.testing.assert_close(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1), expected)
    row = autogaudi.report().unit("fused_clip_norm")
    assert (row["status"], row["reason_code"]) == ("failed", "failed_at_run_time")
    assert row["reason_params"]["error"].startswith("ZeroDivisionError")
    assert torch.nn.utils.clip_grad_norm_ is original  # reverted


def test_skipped_on_cpu_with_the_reason():
    autogaudi.enable()
    row = autogaudi.report().unit("fused_clip_norm")
    assert (row["status"], row["reason_code"]) == ("skipped", "other_backend")


def test_fsdp2_shards_keep_torchs_norm_over_every_rank(calls, process_group):
    """FusedClipNorm would take this rank's shards' norm; torch's takes the global one (the same on
    one rank, so the numbers say nothing: the path taken does)."""
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(grads())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    assert calls.names() == []
    assert autogaudi.report().unit("fused_clip_norm")["figures"] == {"fused_calls": 0, "torch_calls": 1}
    assert autogaudi.report().unit("fused_clip_norm")["numerics_measured"] is None  # torch's own ran
