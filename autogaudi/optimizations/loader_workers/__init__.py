"""DataLoader worker processes for loaders measured to starve the step: the unit's decisions in
:mod:`.unit`, its mechanisms beside it (:mod:`.safety`, :mod:`.worker_iterator`, :mod:`.thread_cut`,
:mod:`.loader_state`)."""

from autogaudi.optimizations.loader_workers.unit import LoaderWorkers

__all__ = ["LoaderWorkers"]
