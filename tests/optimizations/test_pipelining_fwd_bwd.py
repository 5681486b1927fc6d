"""pipelining_fwd_bwd: opt-in; when forced, one more mark_step just before each backward."""

import autogaudi
from tests.optimizations.test_step_marks import MARK, standard_loop


def test_off_unless_forced(hpu_double):
    hpu_double(lazy=True)
    autogaudi.enable(device="hpu")
    row = autogaudi.report().unit("pipelining_fwd_bwd")
    assert (row["status"], row["reason_code"]) == ("skipped", "opt_in")


def test_forced_marks_before_backward_and_keeps_losses(hpu_double):
    calls = hpu_double(lazy=True)
    plain = standard_loop()
    autogaudi.enable(device="hpu", only="step_marks,pipelining_fwd_bwd", force="pipelining_fwd_bwd")
    calls.reset()
    assert standard_loop() == plain
    assert calls.names() == [MARK, MARK, MARK] * 4  # before backward, after backward, after step
    assert autogaudi.report().unit("pipelining_fwd_bwd")["figures"] == {"mark_steps": 4}


def test_eager_mode_skips(hpu_double):
    hpu_double(lazy=False)
    autogaudi.enable(device="hpu", force="pipelining_fwd_bwd")
    assert autogaudi.report().unit("pipelining_fwd_bwd")["reason_code"] == "hpu_eager"


def test_failure_at_run_time_reverts_and_training_goes_on(hpu_double, monkeypatch):
    hpu_double(lazy=True)
    plain = standard_loop()
    autogaudi.enable(device="hpu", only="pipelining_fwd_bwd", force="pipelining_fwd_bwd")
    import habana_frameworks.torch.core as htcore

    monkeypatch.setattr(htcore, "mark_step", lambda *args, **kwargs: 1 / 0)
    assert standard_loop() == plain
    row = autogaudi.report().unit("pipelining_fwd_bwd")
    assert (row["status"], row["reason_code"]) == ("failed", "failed_at_run_time")
    assert row["reason_params"]["error"].startswith("ZeroDivisionError")
