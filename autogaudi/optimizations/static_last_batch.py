"""Every batch the same shape: an epoch's short last batch filled up (or dropped) where shapes matter.

Why: where a new input shape is a new graph to compile (HPU lazy mode, graph capture, the script's
own ``torch.compile``: :mod:`autogaudi.optimizations.shape_buckets.matter`, which shape_buckets
decides by too), a short last batch is one more shape, every epoch (recompilation is the most
reported Gaudi slowdown). Default policy ``repeat``: the epoch's index order is extended with its
own first indices until it fills the last batch, as optimum-habana's sampler does; every original
sample is still seen once per epoch. Zero padding is not offered: it would pollute BatchNorm
statistics (shape_buckets refuses the batch dimension for the same reason). Policy ``drop``: the
short batch's indices are left out. Semantic change (reported): the repeated samples are seen twice
in that epoch (or, dropped, not at all).
The sampler decides when its epoch reaches the short batch: HPU lazy mode from the first epoch;
elsewhere once the profiled training model is compiled per shape (so a capture kept later pads the
epochs from then on), never on an eager run.
Untouched: ``drop_last=True`` loaders, a ``batch_sampler`` or a sampler of the script's own other
than torch's plain Random/SequentialSampler (wrapping, say, a DistributedSampler would hide its
``set_epoch`` and type from the script), iterable datasets, loaders without ``batch_size``, and
epochs that already divide evenly. Where the training model turns out to be on the host
(:mod:`autogaudi.watch.placement`), no later epoch is padded.
"""

from __future__ import annotations

from torch.utils.data import IterableDataset, RandomSampler, Sampler, SequentialSampler

from autogaudi.core.events import Event
from autogaudi.core.unit import DATA, Unit, UnitSpec
from autogaudi.optimizations.shape_buckets.matter import compiled_for_shapes
from autogaudi.watch.steps import loader_arguments


class PaddedSampler(Sampler):
    """The indices of ``sampler`` for one epoch, its short last batch (of ``multiple``) filled with the
    epoch's own first indices (``repeat``) or left out (``drop``) where ``whole()`` says so at the time."""

    def __init__(self, sampler, multiple: int, policy: str, whole):
        self.sampler = sampler
        self.multiple = multiple
        self.policy = policy
        self.whole = whole

    def __len__(self) -> int:
        count = len(self.sampler)
        short = count % self.multiple
        if not short or not self.whole():
            return count
        return count - short if self.policy == "drop" else count - short + self.multiple

    def __iter__(self):
        kept = len(self.sampler) - len(self.sampler) % self.multiple
        first, short = [], []
        for position, index in enumerate(self.sampler):
            if len(first) < self.multiple:
                first.append(index)
            if position < kept:
                yield index
            else:
                short.append(index)  # held until the epoch's end, where whether to fill it is decided
        if not short or not self.whole():
            yield from short
        elif self.policy == "repeat":
            missing = self.multiple - len(short)
            yield from short
            yield from (first * (missing // len(first) + 1))[:missing]


class StaticLastBatch(Unit):
    spec = UnitSpec(
        numerics=(DATA,),
        reasons={
            "policy": "policy {policy}",
            "waiting": "a short last batch is kept whole once graph capture or torch.compile takes the training model",
            "eager": "nothing padded: shapes cost nothing on this eager {backend} run (no graph capture or "
            "torch.compile)",
            "hpu_eager": "HPU eager mode compiles nothing per shape unless graph capture or torch.compile is on",
            "own_sampler": "a loader with its own {sampler} is not padded (its sampler stays the script's)",
            "repeats_samples": "each epoch's last batch repeats samples from the epoch's start "
            "(--last-batch drop: drop it)",
        },
        changed_figure=("loaders_padded", "{} DataLoader(s) padded to whole batches"),
        acts_on=("DataLoader construction (the session's step watcher)",),
        acts_for_device=True,
    )

    def apply(self) -> None:
        self.report.figures.update(loaders_padded=0, samples_added_per_epoch=0)
        self._model = None
        self._aside = False
        self.scope.on(Event.LOADER_BUILT, self._adjust)
        if self.run.backend.is_lazy:
            self.report.because("policy", policy=self.run.options.last_batch)
        else:
            self.scope.on(Event.STEP_PROFILED, self._profiled)
            self.report.because("waiting")

    def _profiled(self, profile) -> None:
        self._model = profile.model
        if compiled_for_shapes(self._model, self.run.options) is None:
            code = "hpu_eager" if self.run.backend.name == "hpu" else "eager"
            self.report.because(code, backend=self.run.backend.name)

    def _shapes_matter(self) -> bool:
        if self._aside:
            return False
        return self.run.backend.is_lazy or compiled_for_shapes(self._model, self.run.options) is not None

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
            self.report.note("own_sampler", sampler=type(sampler).__name__)
            return None
        if sampler is None:
            sampler = (
                RandomSampler(dataset, generator=call["generator"]) if call["shuffle"] else SequentialSampler(dataset)
            )
        remainder = len(sampler) % batch_size
        if remainder == 0:
            return None
        added = -remainder if self.run.options.last_batch == "drop" else batch_size - remainder
        padded = PaddedSampler(sampler, batch_size, self.run.options.last_batch, self._whole_for(added))
        return (), {**call, "sampler": padded, "shuffle": None}

    def _whole_for(self, added: int):
        """A sampler's ``whole``: whether shapes matter now; the first time they do, counted."""
        counted = []

        def whole() -> bool:
            if not self._shapes_matter():
                return False
            if not counted:
                counted.append(True)
                self.report.figures["loaders_padded"] += 1
                self.report.figures["samples_added_per_epoch"] += added
                self.report.because("policy", policy=self.run.options.last_batch)
                if added > 0:
                    self.report.note("repeats_samples")
            return True

        return whole

    def step_aside(self) -> None:
        self._aside = True
