"""The step count's rules as plain calls: sequences of backward passes and optimizer steps, and the
training steps they make, without torch or its patches."""

import pytest

from autogaudi.watch.step_count import BY_BACKWARD, BY_OPTIMIZER, NO_OPTIMIZER_AFTER, REPACE_AFTER, StepCount


class Optimizer:
    """Any object a weak reference can name stands for an optimizer here."""


A, B = "A", "B"  # optimizers in a sequence
# a sequence's events: "b" a backward pass after its gradients were cleared, "+" one accumulating
# into the last, "c" one inside an optimizer step (a closure), "o" autogaudi's own; A or B a step
CASES = {
    "one optimizer": (["b", A] * 5, (5, BY_OPTIMIZER, 5)),
    "two optimizers per iteration (a GAN)": (["b", A, "b", B] * 6, (6, BY_OPTIMIZER, 12)),
    "a closure's passes are inside one step": (["c", "c", "c", A] * 3, (3, BY_OPTIMIZER, 3)),
    "autogaudi's own passes are not counted": (["o", "b", A] * 4, (4, BY_OPTIMIZER, 4)),
    "by hand: the passes before the mode was known count": (["b"] * 20, (20, BY_BACKWARD, 0)),
    "by hand with accumulation of 4": ((["b"] + ["+"] * 3) * 10, (10, BY_BACKWARD, 0)),
    "by hand, not yet known": (["b"] * (NO_OPTIMIZER_AFTER - 1), (0, None, 0)),
    "the pacer hands over to one that steps alone": (
        [A] * 2 + [B] * (REPACE_AFTER + 3),
        (2 + 3, BY_OPTIMIZER, 2 + REPACE_AFTER + 3),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_sequence_makes_its_steps(name):
    sequence, (steps, counted_by, optimizer_steps) = CASES[name]
    count, optimizers, ended = StepCount(), {A: Optimizer(), B: Optimizer()}, 0
    for event in sequence:
        if event in optimizers:
            count.optimizer_stepped()
            ended += count.paced_by(optimizers[event])
        elif event == "o":
            count.own_backward()
        else:
            ended += count.backward(cleared=event != "+", in_optimizer_step=event == "c")
    assert (count.steps, count.counted_by, count.optimizer_steps) == (steps, counted_by, optimizer_steps)
    assert ended == count.steps  # what the calls returned is what was counted


def test_accumulation_sets_the_passes_per_step_and_a_closure_counts_apart():
    count = StepCount()
    for _ in range(8):
        count.backward(cleared=True)
        count.backward(cleared=False)
    figures = count.figures()
    assert (figures["steps"], figures["backward_passes_per_step"], figures["backward_passes"]) == (8, 2, 16)
    count = StepCount()
    count.backward(cleared=True, in_optimizer_step=True)
    count.own_backward()
    assert count.figures()["backward_passes_in_optimizer_steps"] == count.figures()["own_backward_passes"] == 1
