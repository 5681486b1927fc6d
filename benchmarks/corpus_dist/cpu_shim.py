"""Runs a pytorch/examples distributed script, unmodified, on CPU ranks (gloo) where no GPU is:

    torchrun --standalone --nproc_per_node 2 ../cpu_shim.py SCRIPT [ARGS...]

Each patch answers one thing the scripts ask of a GPU machine, and does nothing for code that does
not ask it; with CUDA available nothing is patched and the script runs as it is.

- FSDP2/example.py exits unless ``torch.accelerator`` reports two devices (``verify_min_gpu_count``),
  then trains on the CPU where none is: that one check is answered as on a two-GPU machine. Its CPU
  branch passes ``device_id=cpu`` to ``init_process_group``, which torch 2.13 refuses ("must be an
  accelerator with an index"): a CPU ``device_id`` is dropped.
- ddp-tutorial-series/multigpu_torchrun.py: ``torch.cuda.set_device(rank)`` does nothing, backend
  ``"nccl"`` becomes ``"gloo"``, ``.to(rank)`` of a module or a tensor goes to the CPU, and
  DistributedDataParallel gets no ``device_ids`` for a module on the CPU.
"""

import functools
import os
import runpy
import sys

import torch
import torch.distributed
from torch.nn.parallel import DistributedDataParallel


def patch(owner, name, replace):
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(replace(original)))


def answer_gpu_check(original, answer):
    def ask():
        return answer if sys._getframe(1).f_code.co_name == "verify_min_gpu_count" else original()

    return ask


def on_cpu(device):
    """A device given by index (a GPU's, in these scripts) is the CPU."""
    return "cpu" if isinstance(device, int) and not isinstance(device, bool) else device


def to_cpu(original):
    def to(self, *args, **kwargs):
        if args:
            args = (on_cpu(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = on_cpu(kwargs["device"])
        return original(self, *args, **kwargs)

    return to


def process_group_on_cpu(original):
    def init_process_group(backend=None, *args, **kwargs):
        if getattr(kwargs.get("device_id"), "type", None) == "cpu":
            kwargs["device_id"] = None  # binds the group to an accelerator; torch refuses a CPU device
        return original("gloo" if backend == "nccl" else backend, *args, **kwargs)

    return init_process_group


def no_device_ids_on_cpu(original):
    def __init__(self, module, *args, **kwargs):
        if all(param.device.type == "cpu" for param in module.parameters()):
            kwargs["device_ids"] = None
        return original(self, module, *args, **kwargs)

    return __init__


def main():
    if not torch.cuda.is_available():
        patch(torch.accelerator, "is_available", lambda original: answer_gpu_check(original, True))
        patch(torch.accelerator, "device_count", lambda original: answer_gpu_check(original, 2))
        patch(torch.cuda, "set_device", lambda original: lambda device: None)
        patch(torch.distributed, "init_process_group", process_group_on_cpu)
        patch(torch.Tensor, "to", to_cpu)
        patch(torch.nn.Module, "to", to_cpu)
        patch(DistributedDataParallel, "__init__", no_device_ids_on_cpu)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
