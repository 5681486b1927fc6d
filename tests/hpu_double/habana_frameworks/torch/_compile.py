"""torch.compile's ``hpu_backend``, modelling what its compiles count. torch finds it as it finds an
installed bridge's: the ``torch_dynamo_backends`` entry point in this folder's ``*.dist-info``
(looked up on the first ``torch.compile``, which imports this module: the bridge's import does not
pay for dynamo's); a process whose dynamo was loaded before the bridge imports it at load. Every
graph dynamo hands it (a region's first compile, each recompile, each piece a graph break leaves),
forward and backward apart (AOTAutograd, as the bridge's backend), is one ``graph_compilation`` in
the double's metrics, through the recipe cache: with ``PT_HPU_RECIPE_CACHE_CONFIG`` set, a graph
whose recipe an earlier process wrote compiles nothing (a ``recipe_cache`` hit). The graphs run as
AOTAutograd's eager code on the CPU. Not modelled: what a Gaudi's graph compiler fuses or rounds.

Dynamo traces the double's HPU tensors as the host tensors they hold, unwrapped at the boundary:
faking a tensor that answers ``hpu`` aborts the CPU build (no device guard for hpu), and tracing the
subclass's ``__torch_function__`` and the double's device mode would put the double's own Python in
the graph. So, once this module is loaded, dynamo takes an HPU tensor for a plain one (no subclass
type, faked with its class set aside), leaves the double's mode out of what it traces (its guard on
the mode stack still holds it), and ``hpu_backend``'s graphs run on host aliases of their inputs and
hand back HPU tensors. A device read inside a compiled region (``x.device``) is traced as the host's.
"""

import importlib

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend
from torch._dynamo.variables import builder, torch_function
from torch._subclasses import fake_tensor

NAME = "hpu_backend"
_DEVICE_MODULE = "habana_frameworks.torch._device"


def _is_hpu_tensor(value) -> bool:
    """By module name: the in-process tests load the double afresh, each load its own classes."""
    return isinstance(value, torch.Tensor) and type(value).__module__ == _DEVICE_MODULE


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
        # the bridge's modules of this process (tests load the double afresh)
        importlib.import_module("habana_frameworks.torch._calls").record("hpu_backend_compile", kind=kind)
        metrics = importlib.import_module("habana_frameworks.torch.hpu.metrics")
        metrics._count_compilation(1000, _graph_key(kind, graph_module, example_inputs))

        def run_on_host(args):
            """The graph's aten ops on host aliases of its inputs (the same storage), below the double."""
            with torch._C.DisableTorchFunction():
                host = [value.as_subclass(torch.Tensor) if _is_hpu_tensor(value) else value for value in args]
                args.clear()  # the boxed convention: the callee owns its inputs
                return graph_module(*host)

        run_on_host._boxed_call = True
        return run_on_host

    return compiler


def hpu_backend(graph_module, example_inputs, **kwargs):
    compiled = aot_autograd(fw_compiler=_counting("forward"), bw_compiler=_counting("backward"))(
        graph_module, example_inputs, **kwargs
    )

    def run(*args):
        outputs = compiled(*args)
        if any(_is_hpu_tensor(value) for value in args):
            outputs = importlib.import_module(_DEVICE_MODULE).on_hpu(outputs)
        return outputs

    return run


def _plain_to_dynamo(infer_subclass_type):
    def infer(value):
        return None if _is_hpu_tensor(value) else infer_subclass_type(value)

    infer.sees_hpu_tensors_as_host = True
    return infer


def _faked_as_host(from_real_tensor):
    def from_real(converter, fake_mode, tensor, *args, **kwargs):
        if not _is_hpu_tensor(tensor):
            return from_real_tensor(converter, fake_mode, tensor, *args, **kwargs)
        with torch._C.DisableTorchFunction():  # what faking reads too: the gradient, a view's base
            related = [tensor, tensor.grad if tensor.is_leaf else None, tensor._base]
        kinds = {id(value): (value, type(value)) for value in related if _is_hpu_tensor(value)}
        for value, _kind in kinds.values():
            value.__class__ = torch.nn.Parameter if isinstance(value, torch.nn.Parameter) else torch.Tensor
        try:
            return from_real_tensor(converter, fake_mode, tensor, *args, **kwargs)
        finally:
            for value, kind in kinds.values():
                value.__class__ = kind

    from_real.original = from_real_tensor  # what the double's refusal (``_device``) would wrap
    return from_real


def _without_the_doubles_mode(init):
    def traced_state(state, py_stack, *args, **kwargs):
        modes = [mode for mode in py_stack if type(mode).__module__ != _DEVICE_MODULE]
        return init(state, modes, *args, **kwargs)

    traced_state.sees_hpu_tensors_as_host = True
    return traced_state


def _see_hpu_tensors_as_host() -> None:
    """Dynamo's three places that meet an HPU tensor's type, its storage and the double's mode."""
    if getattr(builder.infer_subclass_type, "sees_hpu_tensors_as_host", False):
        return
    builder.infer_subclass_type = _plain_to_dynamo(builder.infer_subclass_type)
    converter = fake_tensor.FakeTensorConverter
    original = getattr(converter.from_real_tensor, "original", converter.from_real_tensor)
    converter.from_real_tensor = _faked_as_host(original)
    state = torch_function.SymbolicTorchFunctionState
    state.__init__ = _without_the_doubles_mode(state.__init__)


def register() -> None:
    """Where dynamo was loaded before the bridge (it may have looked for backends already)."""
    if NAME not in _COMPILER_FNS:
        register_backend(compiler_fn=hpu_backend, name=NAME)


_see_hpu_tensors_as_host()
