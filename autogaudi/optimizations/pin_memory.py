"""``DataLoader(pin_memory=True)`` when an accelerator is the target.

Why: batches in page-locked (pinned) host memory are copied to the device by DMA, faster, and
asynchronously when the copy says ``non_blocking=True`` (see non_blocking_copy): the Gaudi guide's
and the HF guide's advice. Only loaders built without a ``pin_memory`` choice are changed; the
pinning device is the backend's (``"hpu"`` on Gaudi) on torch versions that still take
``pin_memory_device`` (newer ones pin for the current accelerator by themselves).
Cost: pinned memory is locked host memory (one batch per worker in flight).
CPU-only runs: skipped, pinning does nothing without a device to copy to. Loaders are usually built
before the model is placed: where the training model turns out to be on the host
(:mod:`autogaudi.placement`), the loaders pinned so far are unpinned for the iterators they create
from then on (one an epoch; a persistent-worker iterator already running keeps pinning).
"""

from __future__ import annotations

import weakref

import torch

from autogaudi.events import Event
from autogaudi.steps import loader_arguments
from autogaudi.unit import Unit


class PinMemory(Unit):
    reasons = {"pinned": "pinned for {device}"}
    changed_figure = ("loaders_pinned", "{} DataLoader(s) pinning memory")
    acts_on = ("DataLoader construction (the session's step watcher)",)
    acts_for_device = True

    def apply(self) -> None:
        self.figures["loaders_pinned"] = 0
        self._pinned = weakref.WeakSet()
        self._device_argument = not hasattr(torch, "accelerator")  # torch < 2.6 needs the device named
        self.on(Event.LOADER_BUILT, self._adjust)
        self.because("pinned", device=self.backend.device_type)

    def _adjust(self, loader, args, kwargs):
        given = loader_arguments(loader, args, kwargs)
        if given is None or "pin_memory" in given:
            return None  # the script chose
        self.figures["loaders_pinned"] += 1
        self._pinned.add(loader)
        extra = {"pin_memory_device": self.backend.pin_memory_device} if self._device_argument else {}
        return args, {**kwargs, "pin_memory": True, **extra}

    def step_aside(self) -> None:
        for loader in list(self._pinned):
            if loader.pin_memory is True:  # DataLoader reads it at each iterator's creation
                loader.pin_memory = False
