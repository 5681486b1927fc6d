"""``DataLoader(pin_memory=True)`` when an accelerator is the target.

Why: batches in page-locked (pinned) host memory are copied to the device by DMA, faster, and
asynchronously when the copy says ``non_blocking=True`` (see non_blocking_copy): the Gaudi guide's
and the HF guide's advice. Only loaders built without a ``pin_memory`` choice are changed. Which
arguments make a loader pin for the backend's device (``"hpu"`` on Gaudi) is asked of the installed
DataLoader itself (:func:`pinning_arguments`): some pin for the current accelerator alone and
deprecate ``pin_memory_device``, older ones pin for CUDA unless it names the device, whether or not
``torch.accelerator`` exists. Where neither pins here (no accelerator torch can pin for: the HPU test
double on a CPU build), loaders are still set to pin, as on the device, and the report notes it.
Cost: pinned memory is locked host memory (one batch per worker in flight).
CPU-only runs: skipped, pinning does nothing without a device to copy to. Loaders are usually built
before the model is placed: where the training model turns out to be on the host
(:mod:`autogaudi.watch.placement`), the loaders pinned so far are unpinned for the iterators they create
from then on (one an epoch; a persistent-worker iterator already running keeps pinning).
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch.utils.data import DataLoader

from autogaudi.core.events import Event
from autogaudi.core.unit import Unit, UnitSpec
from autogaudi.watch.steps import loader_arguments


class _Probe(DataLoader):
    """A loader of autogaudi's own: the session's loader watcher adjusts the DataLoader class itself only."""


def pins_for(device_type: str, **arguments) -> bool:
    """Whether an iterator of ``DataLoader(..., pin_memory=True, **arguments)`` pins its batches for
    ``device_type``, as this torch decides it (no batch is drawn; nothing pinned; its warnings are the
    probe's). An iterator that pins with no device named pins through ``Tensor.pin_memory()``: CUDA's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # its own generator: the iterator's seed is drawn from it, not from the script's random stream
        iterator = _Probe([0], pin_memory=True, generator=torch.Generator(), **arguments)._get_iterator()
    return bool(iterator._pin_memory) and (getattr(iterator, "_pin_memory_device", None) or "cuda") == device_type


def pinning_arguments(device_type: str):
    """The DataLoader arguments under which this torch's loaders pin for ``device_type``: ``{}`` where
    they pin for it by themselves (naming it is then deprecated), ``pin_memory_device`` where it must
    be named, or None where they pin for it under neither here."""
    if pins_for(device_type):
        return {}
    named = {"pin_memory_device": device_type}
    return named if pins_for(device_type, **named) else None


class PinMemory(Unit):
    spec = UnitSpec(
        reasons={
            "pinned": "pinned for {device}",
            "pins_nothing_here": "this torch's DataLoader pins for no {device} device here (no accelerator it can "
            "pin for): loaders are set to pin as on the device, and torch warns that it cannot",
        },
        changed_figure=("loaders_pinned", "{} DataLoader(s) pinning memory"),
        acts_on=("DataLoader construction (the session's step watcher)",),
        acts_for_device=True,
    )

    def apply(self) -> None:
        self.report.figures["loaders_pinned"] = 0
        self._pinned = weakref.WeakSet()
        device = self.run.backend.pin_memory_device
        self._arguments = pinning_arguments(device)
        if self._arguments is None:
            self._arguments = {}
            self.report.note("pins_nothing_here", device=device)
        self.scope.on(Event.LOADER_BUILT, self._adjust)
        self.report.because("pinned", device=self.run.backend.device_type)

    def _adjust(self, loader, args, kwargs):
        given = loader_arguments(loader, args, kwargs)
        if given is None or "pin_memory" in given:
            return None  # the script chose
        self.report.figures["loaders_pinned"] += 1
        self._pinned.add(loader)
        return args, {**kwargs, "pin_memory": True, **self._arguments}

    def step_aside(self) -> None:
        for loader in list(self._pinned):
            if loader.pin_memory is True:  # DataLoader reads it at each iterator's creation
                loader.pin_memory = False
