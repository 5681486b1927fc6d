"""Backend detection: HPU, then CUDA, then CPU, unless the ``device`` option names one."""

from __future__ import annotations

import importlib.util

import torch

from autogaudi.backends import cpu
from autogaudi.backends.base import NO_BRIDGE, Backend, MemoryStats

__all__ = ["Backend", "MemoryStats", "select"]


def _hpu_probe():
    """:func:`autogaudi.backends.hpu.probe`, its module (and its signals') imported only where the
    Gaudi bridge is installed: without it the answer is known, and a start need not load them."""
    if importlib.util.find_spec("habana_frameworks") is None:
        return NO_BRIDGE
    from autogaudi.backends import hpu

    return hpu.probe()


def _cuda_probe():
    """:func:`autogaudi.backends.cuda.probe`, its module imported only where torch sees a CUDA device:
    a start on a CPU-only machine need not load it."""
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    from autogaudi.backends import cuda

    return cuda.probe()


PROBES = {"hpu": _hpu_probe, "cuda": _cuda_probe, "cpu": cpu.probe}


def select(device: str) -> Backend:
    """The backend to optimize for; its ``reason`` records why, including what was ruled out.

    A requested device that is not usable falls back to detection (the run goes on) and the reason
    says so, since failing the user's run over a setting of ours would be worse.
    """
    ruled_out = []
    order = list(PROBES) if device == "auto" else [device] + [name for name in PROBES if name != device]
    for name in order:
        try:
            found = PROBES[name]()
        except Exception as error:  # a broken driver or bridge install rules the backend out
            found = f"probe failed: {error!r}"
        if isinstance(found, Backend):
            if ruled_out:
                found.reason += "; " + "; ".join(ruled_out)
            return found
        prefix = "requested " if name == device else ""
        ruled_out.append(f"{prefix}{name}: {found}")
    raise AssertionError("the CPU backend is always available")
