"""Every default unit on, against the HPU double in lazy mode: the exact order of bridge calls for
the loop shapes scripts use, and losses equal to plain PyTorch's."""

import torch

import autogaudi
from tests.optimizations.test_step_marks import (
    MARK,
    accumulation_loop,
    lbfgs_loop,
    standard_loop,
    two_optimizers_with_grad_scaler,
)

# The bridge's FusedAdamW marks a step itself in lazy mode: before its (one) param group and after.
ADAMW = ["FusedAdamW.step", MARK, MARK]
# Its FusedSGD marks none in step() but one at the end of __init__ (when the script builds its SGD).
SGD = ["FusedSGD.step"]
SGD_BUILT = MARK
# FusedClipNorm marks a step before clipping and after.
CLIP = [MARK, "FusedClipNorm.clip_norm", MARK]
# step_profiler: after 3 warm-up steps and one clean step, its first census step starts on an idle
# device (the bridge's synchronize marks a step before it waits)
CENSUS_BEGINS = [MARK, "synchronize"]


def sequence(hpu_double, loop):
    calls = hpu_double(lazy=True)
    plain = loop()
    autogaudi.enable(device="hpu")
    calls.reset()
    losses = loop()
    torch.testing.assert_close(losses, plain, rtol=2e-4, atol=1e-5)  # FusedAdamW's eps placement
    return calls.names()


def test_standard_loop_with_clipping(hpu_double):
    step = [MARK, *CLIP, *ADAMW, MARK]  # backward, clip, fused step, step mark
    expected = [MARK, "FusedClipNorm", *CLIP, *ADAMW, MARK] + step * 3 + CENSUS_BEGINS  # FusedClipNorm built once
    assert sequence(hpu_double, lambda: standard_loop(clip=True)) == expected


def test_grad_scaler_with_two_optimizers(hpu_double):
    # Adam without weight decay runs as FusedAdamW; each optimizer step is followed by a mark. One
    # iteration is one training step, paced by the first optimizer to step (SGD): 3 warm-up
    # iterations, a clean one, and the profiler's first census step starts after SGD's 4th step.
    iteration = [MARK, *SGD, MARK, *ADAMW, MARK]
    expected = [SGD_BUILT] + iteration * 3 + [MARK, *SGD, MARK, *CENSUS_BEGINS, *ADAMW, MARK]
    assert sequence(hpu_double, lambda: two_optimizers_with_grad_scaler(steps=4)) == expected


def test_gradient_accumulation(hpu_double):
    assert sequence(hpu_double, accumulation_loop) == [SGD_BUILT] + [MARK, MARK, *SGD, MARK] * 3


def test_lbfgs_has_no_fused_kernel_and_is_marked(hpu_double):
    names = sequence(hpu_double, lbfgs_loop)
    assert set(names) == {MARK}
    row = autogaudi.report().unit("fused_optimizer")
    # LBFGS is not among the classes it fuses: not even counted as kept.
    assert (row["figures"], row["notes"]) == ({"optimizers_fused": 0, "optimizers_kept": 0}, [])
