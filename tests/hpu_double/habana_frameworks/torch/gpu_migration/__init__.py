"""Test double of Intel's GPU migration toolkit (``habana_frameworks.torch.gpu_migration``).

What the docs (docs.habana.ai, GPU Migration Toolkit, read 2026-11-26) say it maps, modelled: torch.cuda
calls onto torch.hpu (``is_available`` True, device count and name, ``synchronize``, seeds and RNG state, memory
figures), and "cuda" device arguments onto hpu (``Tensor.to``, ``Module.to``, ``.cuda()``, factory
functions' ``device=``), onto the double's HPU tensors (:mod:`habana_frameworks.torch._device`).
Every mapped call is counted (:func:`mapped_calls`, the double's own: the real toolkit logs its
mappings with GPU_MIGRATION_LOG_LEVEL instead) and recorded in ``_calls.CALLS`` as
``("gpu_migration", {"call": name})``. Not modelled: Apex, pynvml, DataLoader's pin_memory_device,
DDP's device_ids, ``torch.distributed`` backends (nccl -> hccl), and every torch.cuda call not listed here.
"""

import functools

import torch

import habana_frameworks.torch  # noqa: F401  (the real toolkit loads the bridge)
from habana_frameworks.torch import _calls, hpu

_MAPPED = [0]
_FACTORIES = ("randn", "rand", "zeros", "ones", "empty", "full", "tensor", "arange", "randint")


def mapped_calls() -> int:
    return _MAPPED[0]


def _mapped(name):
    _MAPPED[0] += 1
    _calls.record("gpu_migration", call=name)


def _is_cuda(device) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    if isinstance(device, int) and not isinstance(device, bool):
        return False
    return isinstance(device, torch.device) and device.type == "cuda"


def _map_device_args(name, args, kwargs):
    """The call's arguments with a cuda device replaced by hpu; whether any was."""
    mapped = False
    if _is_cuda(kwargs.get("device")):
        kwargs = {**kwargs, "device": "hpu"}
        mapped = True
    if args and _is_cuda(args[0]):
        args = ("hpu", *args[1:])
        mapped = True
    if mapped:
        _mapped(name)
    return args, kwargs


def _patch(owner, attribute, make):
    original = getattr(owner, attribute)
    setattr(owner, attribute, functools.wraps(original)(make(original)))


def _mapping(name):
    def make(original):
        def call(self, *args, **kwargs):
            args, kwargs = _map_device_args(name, args, kwargs)
            return original(self, *args, **kwargs)

        return call

    return make


def _tensor_cuda(original):
    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        _mapped("Tensor.cuda")
        return self.to("hpu", non_blocking=non_blocking, memory_format=memory_format)

    return cuda


def _module_cuda(original):
    def cuda(self, device=None):
        _mapped("Module.cuda")
        return self.to("hpu")

    return cuda


def _factory(original):
    def make(*args, **kwargs):
        _, kwargs = _map_device_args(f"torch.{original.__name__}", (), kwargs)
        return original(*args, **kwargs)

    return make


def _onto_hpu(name, target):
    def call(*args, **kwargs):
        _mapped(f"torch.cuda.{name}")
        return target(*args, **kwargs)

    return call


_patch(torch.Tensor, "to", _mapping("Tensor.to"))
_patch(torch.nn.Module, "to", _mapping("Module.to"))
_patch(torch.Tensor, "cuda", _tensor_cuda)
_patch(torch.nn.Module, "cuda", _module_cuda)
for _name in _FACTORIES:
    _patch(torch, _name, _factory)
for _name, _target in {
    "is_available": hpu.is_available,
    "device_count": hpu.device_count,
    "current_device": hpu.current_device,
    "get_device_name": hpu.get_device_name,
    "synchronize": hpu.synchronize,
    "set_device": hpu.set_device,
    # the device's generator is the CPU's here (torch.manual_seed itself calls torch.cuda.manual_seed_all)
    "manual_seed": torch.default_generator.manual_seed,
    "manual_seed_all": torch.default_generator.manual_seed,
    # dynamo saves and restores them around each frame it compiles where torch.cuda is available
    "get_rng_state": hpu.get_rng_state,
    "set_rng_state": hpu.set_rng_state,
    "memory_allocated": hpu.memory_allocated,
    "max_memory_allocated": hpu.max_memory_allocated,
}.items():
    setattr(torch.cuda, _name, _onto_hpu(_name, _target))
_calls.record("gpu_migration_loaded")
