"""torch.compile's ``hpu_backend``, modelling what its compiles count. torch finds it as it finds an
installed bridge's: the ``torch_dynamo_backends`` entry point in this folder's ``*.dist-info``
(looked up on the first ``torch.compile``, so the bridge's import does not pay for dynamo's); a
process whose dynamo looked before the bridge loaded has it registered at load. Every graph dynamo
hands it (a region's first compile, each recompile, each piece a graph break leaves), forward and
backward apart (AOTAutograd, as the bridge's backend), is one ``graph_compilation`` in the double's
metrics, through the recipe cache: with ``PT_HPU_RECIPE_CACHE_CONFIG`` set, a graph whose recipe an
earlier process wrote compiles nothing (a ``recipe_cache`` hit). The graphs run as AOTAutograd's
eager code on the CPU. Not modelled: what a Gaudi's graph compiler fuses or rounds.

Dynamo cannot trace the double's HPU tensors: faking a tensor that answers ``hpu`` aborts the
process in the CPU build (torch has no device guard for hpu). So a frame that meets one is told its
tensor cannot be faked (torch's ``UnsupportedFakeTensorException``): dynamo counts a graph break and
runs the frame eagerly. Compiles are modelled on host tensors only (the in-process tests' stand-ins).
"""

import importlib
import sys

import torch
from torch._subclasses import fake_tensor

NAME = "hpu_backend"
_DEVICE_MODULE = "habana_frameworks.torch._device"


def _graph_key(kind, graph_module, example_inputs):
    """What a recipe depends on: the graph's code and its inputs' shapes, strides and dtypes."""
    inputs = tuple(
        (tuple(value.shape), tuple(value.stride()), str(value.dtype))
        if isinstance(value, torch.Tensor)
        else repr(value)
        for value in example_inputs
    )
    return kind, graph_module.code, inputs


def _counting(kind):
    def compiler(graph_module, example_inputs):
        from functorch.compile import make_boxed_func

        # the bridge's modules of this process (tests load the double afresh)
        importlib.import_module("habana_frameworks.torch._calls").record("hpu_backend_compile", kind=kind)
        metrics = importlib.import_module("habana_frameworks.torch.hpu.metrics")
        metrics._count_compilation(1000, _graph_key(kind, graph_module, example_inputs))
        return make_boxed_func(graph_module.forward)

    return compiler


def hpu_backend(graph_module, example_inputs, **kwargs):
    from torch._dynamo.backends.common import aot_autograd

    compile_both = aot_autograd(fw_compiler=_counting("forward"), bw_compiler=_counting("backward"))
    return compile_both(graph_module, example_inputs, **kwargs)


def _refusing_hpu_tensors(from_real_tensor):
    def from_real(converter, fake_mode, tensor, *args, **kwargs):
        if type(tensor).__module__ == _DEVICE_MODULE:
            raise fake_tensor.UnsupportedFakeTensorException("the HPU double's tensors cannot be traced by dynamo")
        return from_real_tensor(converter, fake_mode, tensor, *args, **kwargs)

    from_real.refuses_hpu_tensors = True
    return from_real


def install():
    """Keep dynamo off the double's HPU tensors; register ``hpu_backend`` where dynamo has already
    looked for backends (elsewhere its entry point is found on the first compile)."""
    converter = fake_tensor.FakeTensorConverter
    if not getattr(converter.from_real_tensor, "refuses_hpu_tensors", False):
        converter.from_real_tensor = _refusing_hpu_tensors(converter.from_real_tensor)
    registry = sys.modules.get("torch._dynamo.backends.registry")
    if registry is not None and NAME not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=hpu_backend, name=NAME)
