"""How many training steps the loop made: a state machine fed plain facts, no torch in it.

Why apart from the watch (:mod:`autogaudi.watch.steps`): the rules that turn backward passes and optimizer
steps into iterations of the user's loop (a pacer among several optimizers, a loop without an
optimizer counted by its backward passes, accumulation) are the part that is easy to get wrong and
hard to test through torch's patches. Here each rule is a method call and its answer a count, so a
table of sequences checks them (tests/watch/test_step_count.py).

The watch tells it what happened (:meth:`backward`, :meth:`own_backward`, :meth:`optimizer_stepped` then
:meth:`paced_by`);
those that can end steps return how many ended (0, 1, or the passes counted after the fact once a
loop turns out to have no optimizer).
"""

from __future__ import annotations

import weakref

from autogaudi.measure.trials import median

NO_OPTIMIZER_AFTER = 16  # backward passes with no optimizer step before backward passes count as steps
REPACE_AFTER = 8  # steps of another optimizer in a row, the pacer silent, before it paces instead
BY_OPTIMIZER, BY_BACKWARD = "optimizer steps", "backward passes"


class StepCount:
    def __init__(self):
        self.backwards = 0  # the user's backward passes (and torch.autograd.grad calls), all of them
        self.backwards_in_optimizer_steps = 0  # of which inside an optimizer step: step(closure)
        self.own_backwards = 0  # autogaudi's own, and passes inside another pass: not the loop's
        self.optimizer_steps = 0
        self.steps = 0  # training steps: iterations of the user's loop
        self.counted_by = None  # BY_OPTIMIZER or BY_BACKWARD once the first step is seen
        self.per_step = 1  # backward passes per step once counted by backward passes
        self._pacer = None  # weak reference to the optimizer whose steps are the training steps
        self._others_in_a_row = 0
        self._since_cleared = 0  # passes since the gradients were last cleared
        self._cycles: list = []  # passes between clearings, before the counting mode is known

    @property
    def asks_clearing(self) -> bool:
        """Whether :meth:`backward` reads its ``cleared`` fact: only while the loop may be one without
        an optimizer (an optimizer's steps count the steps otherwise); the watch may skip finding it."""
        return self.counted_by != BY_OPTIMIZER

    def own_backward(self) -> None:
        """A backward pass that is not the loop's: autogaudi's own, or one inside another pass."""
        self.own_backwards += 1

    def backward(self, cleared: bool, in_optimizer_step: bool = False) -> int:
        """One of the loop's backward passes; ``cleared``: the gradients were cleared since the last
        one (where not, it accumulates into it); ``in_optimizer_step``: it ran inside a step
        (``step(closure)``). Returns the training steps it ended."""
        self.backwards += 1
        if in_optimizer_step:
            self.backwards_in_optimizer_steps += 1
            return 0
        if self.counted_by == BY_OPTIMIZER:
            return 0
        if cleared and self._since_cleared:
            if self.counted_by is None:
                self._cycles.append(self._since_cleared)
            self._since_cleared = 0
        self._since_cleared += 1
        if self.counted_by is None:
            if self.backwards < NO_OPTIMIZER_AFTER or self.optimizer_steps:
                return 0
            return self._count_by_backward()
        if self._since_cleared % self.per_step == 0:
            return self._ended(1)
        return 0

    def _count_by_backward(self) -> int:
        """No optimizer: from now on k backward passes make a step, k the passes between gradient
        clearings seen so far (1 where none were seen); the passes so far are counted now, as the
        steps they made."""
        self.counted_by = BY_BACKWARD
        self.per_step = max(1, round(median(self._cycles))) if self._cycles else 1
        done = len(self._cycles) + self._since_cleared // self.per_step
        self._since_cleared %= self.per_step
        return self._ended(done)

    def optimizer_stepped(self) -> None:
        """An optimizer stepped: counted before the step's listeners hear it, which still see the
        training step it may end as running (:meth:`paced_by` ends it after them)."""
        self.optimizer_steps += 1

    def paced_by(self, optimizer) -> int:
        """The step of ``optimizer`` (any object a weak reference can name), once heard: returns the
        training steps it ended, 1 where it paces the loop (the first to step, or one that stepped
        ``REPACE_AFTER`` times in a row without the pacer), else 0."""
        pacer = self._pacer() if self._pacer is not None else None
        if pacer is optimizer:
            self._others_in_a_row = 0
            return self._ended(1)
        self._others_in_a_row += 1
        if pacer is None or self._others_in_a_row > REPACE_AFTER:
            self._pacer, self._others_in_a_row, self.counted_by = weakref.ref(optimizer), 0, BY_OPTIMIZER
            return self._ended(1)
        return 0

    def _ended(self, steps: int) -> int:
        self.steps += steps
        return steps

    def figures(self) -> dict:
        return {
            "steps": self.steps,
            "steps_counted_by": self.counted_by,
            "backward_passes": self.backwards,
            "backward_passes_per_step": self.per_step if self.counted_by == BY_BACKWARD else None,
            "backward_passes_in_optimizer_steps": self.backwards_in_optimizer_steps,
            "own_backward_passes": self.own_backwards,
            "optimizer_steps": self.optimizer_steps,
        }
