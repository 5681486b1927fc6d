"""Every batch the same shape: pad the epoch to a whole number of batches (HPU lazy mode).

Why: in Gaudi lazy mode every new input shape is a new graph to compile, and a short last batch
is one more shape, every epoch (recompilation is the most reported Gaudi slowdown). Default policy
``repeat``: the epoch's index order is extended with its own first indices until it fills the last
batch, as optimum-habana's sampler does; every original sample is still seen once per epoch.
Zero padding is not offered: it would pollute BatchNorm statistics. Policy ``drop``: ``drop_last=True``.
Semantic change (reported): the repeated samples are seen twice in that epoch.
Untouched: ``drop_last=True`` loaders, a ``batch_sampler`` or a sampler of the script's own other
than torch's plain Random/SequentialSampler (wrapping, say, a DistributedSampler would hide its
``set_epoch`` and type from the script), iterable datasets, loaders without ``batch_size``, and
epochs that already divide evenly.
Elsewhere skipped until graph capture (which also needs static shapes) is switched on.
Where the training model turns out to be on the host (:mod:`autogaudi.placement`), the samplers
padded so far stop padding from their next epoch: an epoch that started before that was known keeps
its padding (said in the row's figures).
"""

from __future__ import annotations

import weakref

from torch.utils.data import IterableDataset, RandomSampler, Sampler, SequentialSampler

from autogaudi.events import Event
from autogaudi.steps import loader_arguments
from autogaudi.unit import DATA, Unit


class PaddedSampler(Sampler):
    """The indices of ``sampler`` for one epoch, extended with its own first indices up to a
    multiple of ``multiple``."""

    def __init__(self, sampler, multiple: int):
        self.sampler = sampler
        self.multiple = multiple
        self.padding = True  # False: the plain sampler's epoch (the unit stepped aside)

    def __len__(self) -> int:
        if not self.padding:
            return len(self.sampler)
        return -(-len(self.sampler) // self.multiple) * self.multiple

    def __iter__(self):
        if not self.padding:
            yield from self.sampler
            return
        indices = list(self.sampler)
        missing = len(self) - len(indices)
        yield from indices
        yield from (indices * (missing // max(len(indices), 1) + 1))[:missing]


class StaticLastBatch(Unit):
    numerics = (DATA,)
    reasons = {
        "hpu_eager": "HPU eager mode compiles nothing per shape unless graph capture is on",
        "policy": "policy {policy}",
        "own_sampler": "a loader with its own {sampler} is not padded (its sampler stays the script's)",
        "repeats_samples": "each epoch's last batch repeats samples from the epoch's start "
        "(--last-batch drop: drop it)",
    }
    changed_figure = ("loaders_padded", "{} DataLoader(s) padded to whole batches")
    acts_on = ("DataLoader construction (the session's step watcher)",)
    acts_for_device = True

    def skip_reason(self):
        reason = super().skip_reason()
        if reason is None and not self.backend.is_lazy:
            reason = self.reason_for("hpu_eager")
        return reason

    def apply(self) -> None:
        self.figures.update(loaders_padded=0, samples_added_per_epoch=0)
        self._samplers = weakref.WeakSet()
        self.on(Event.LOADER_BUILT, self._adjust)
        self.because("policy", policy=self.options.last_batch)

    def _adjust(self, loader, args, kwargs):
        call = loader_arguments(loader, args, kwargs, defaults=True)
        if call is None:
            return None
        dataset, batch_size = call["dataset"], call["batch_size"]
        if (
            call["drop_last"]
            or call["batch_sampler"] is not None
            or batch_size is None
            or isinstance(dataset, IterableDataset)
        ):
            return None
        # The sampler DataLoader itself would build, or the script's own if it is one of those.
        sampler = call["sampler"]
        if sampler is not None and type(sampler) not in (RandomSampler, SequentialSampler):
            self.note("own_sampler", sampler=type(sampler).__name__)
            return None
        if sampler is None:
            sampler = (
                RandomSampler(dataset, generator=call["generator"]) if call["shuffle"] else SequentialSampler(dataset)
            )
        remainder = len(sampler) % batch_size
        if remainder == 0:
            return None
        self.figures["loaders_padded"] += 1
        if self.options.last_batch == "drop":
            self.figures["samples_added_per_epoch"] -= remainder
            return (), {**call, "drop_last": True}
        self.figures["samples_added_per_epoch"] += batch_size - remainder
        self.note("repeats_samples")
        padded = PaddedSampler(sampler, batch_size)
        self._samplers.add(padded)
        return (), {**call, "sampler": padded, "shuffle": None}

    def step_aside(self) -> None:
        for sampler in list(self._samplers):
            sampler.padding = False
