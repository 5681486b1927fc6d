"""Not part of the real bridge: the double's HPU tensors, which compute on the CPU and report ``hpu``.

Why this mechanism: torch's CPU build has an ``hpu`` device type but no device guard for it, so a
tensor whose storage is really on hpu (``_make_wrapper_subclass``) reports the device but aborts
the process in autograd's backward; PrivateUse1 (``rename_privateuse1_backend``) cannot take the
name, which torch reserves for its own HPU type. So an HPU tensor here is :class:`HpuTensor`, a
``__torch_function__`` subclass that keeps CPU storage and answers ``device`` with ``hpu:0``; every
op on one returns one, and an op that meets one and a host tensor of one or more dimensions raises
as on a Gaudi (a 0-dim host tensor is a scalar there too; copies and indexing may cross, as there).
:class:`_OnHpu`, a torch-function mode the bridge's import enters for the rest of the process, maps
``device="hpu"`` of factories, ``.to("hpu")`` (a copy, as a host-to-device copy is), ``.to("cpu")``
and ``.cpu()`` (back to a plain tensor), and keeps parameters HPU ones through ``Module.to``
(``_apply`` sets ``param.data``: the parameter's class follows the data it is given).
In lazy mode every op on an HPU tensor joins the step's graph (its name, and the shapes and dtypes
of its tensors), and the step's end (``mark_step``, or a value read to the host) runs that graph:
compiled where its key is new (the ``graph_compilation`` metric), a cache hit where it is not.
Not modelled: a second device, streams, device memory, ``non_blocking`` timing; a tensor saved with
torch.save is a host tensor (a Gaudi's is reloaded onto hpu); torch.compile's tracing of a subclass.
"""

import hashlib
import importlib

import torch
from torch._subclasses import fake_tensor
from torch.overrides import TorchFunctionMode
from torch.utils import _foreach_utils, _pytree

HPU = torch.device("hpu", 0)
_BASE = torch._C.TensorBase  # its methods, as torch hands them to __torch_function__ (torch.Tensor's may be patched)
_DATA = _BASE.__dict__["data"]


def _is_hpu(device) -> bool:
    if isinstance(device, str):
        return device.split(":")[0] == "hpu"
    return isinstance(device, torch.device) and device.type == "hpu"


def _is_method(func, name: str) -> bool:
    """Whether ``func`` is the tensor method ``name``: torch hands the mode torch.Tensor's attribute,
    which a library (GPU migration, autogaudi) may have replaced by a wrapper of its own."""
    original = getattr(_BASE, name)
    for _ in range(8):  # through functools.wraps' and wrapt's wrappers, and bound methods
        if func is original or func is None:
            return func is original
        func = getattr(func, "__wrapped__", None) or getattr(func, "__func__", None)
    return False


def _is_data_setter(func) -> bool:
    return getattr(func, "__self__", None) is _DATA and func.__name__ == "__set__"


class HpuTensor(torch.Tensor):
    """A tensor on the double's hpu: CPU storage underneath."""

    @property
    def device(self):
        return HPU

    @property
    def is_cpu(self):
        return False

    @property
    def is_hpu(self):
        return True

    def __repr__(self, **kwargs):
        return super().__repr__(**kwargs).replace(f"{type(self).__name__}(", "tensor(", 1)

    def __reduce_ex__(self, protocol):
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor.__reduce_ex__(self.as_subclass(torch.Tensor), protocol)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = _pytree.tree_leaves((args, kwargs))
        if func not in _MAY_CROSS and not _is_data_setter(func) and not _is_method(func, "to"):
            _one_device(leaves)
        if _is_lazy():
            _queue(func, leaves)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        return on_hpu(result, inputs=(args, kwargs))


class HpuParameter(HpuTensor, torch.nn.Parameter):
    """A parameter moved to hpu by ``Module.to`` (its ``data`` set to an HPU tensor)."""

    __torch_function__ = HpuTensor.__torch_function__

    def __repr__(self):
        return "Parameter containing:\n" + HpuTensor.__repr__(self)


# Calls that may take a host tensor and an HPU one, as on a device: copies, indexing, and torch's
# own bookkeeping of Module.to (``_apply``).
_MAY_CROSS = {
    _BASE.copy_,
    _BASE.__getitem__,
    _BASE.__setitem__,
    _BASE.to,
    _BASE.cpu,
    torch._has_compatible_shallow_copy_type,
}


def _one_device(leaves) -> None:
    hpu = host = False
    for leaf in leaves:
        if isinstance(leaf, HpuTensor):
            hpu = True
        elif isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.device.type == "cpu":
            host = True
    if hpu and host:
        raise RuntimeError(
            "Expected all tensors to be on the same device, but found at least two devices, hpu:0 and cpu!"
        )


# Lazy mode's graphs. Calls that read a tensor's metadata queue nothing; calls that read its values
# on the host run the graph queued so far first, as the bridge must to give the value.
_METADATA = {"__get__", "__set__", "size", "dim", "stride", "numel", "is_contiguous", "data_ptr", "element_size"}
_READS_TO_HOST = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__repr__", "__format__"}
LAZY_COMPILE_MICROS = 1000  # what each graph's compilation adds to the metric's TotalTime
_STEP = []  # the hash of the ops queued since the last graph ran (empty: none queued)
_GRAPHS = set()  # the keys of the graphs compiled in this process
_LAZY = []


def _is_lazy() -> bool:
    if not _LAZY:
        _LAZY.append(importlib.import_module("habana_frameworks.torch.utils.internal").is_lazy())
    return _LAZY[0]


def _queue(func, leaves) -> None:
    """Lazy mode: ``func`` joins the step's graph, keyed by its name and its tensors' shapes and dtypes
    (Python numbers are not part of the key: whether the bridge bakes them in is not read)."""
    name = getattr(func, "__name__", None) or repr(func)
    if name in _METADATA:
        return
    if name in _READS_TO_HOST:
        run_graph()
        return
    if not _STEP:
        _STEP.append(hashlib.blake2b(digest_size=16))
    shapes = [(tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves if isinstance(leaf, torch.Tensor)]
    _STEP[0].update(repr((name, shapes)).encode())


def run_graph() -> None:
    """Not bridge API (core's ``mark_step`` and reads to the host call it): the ops queued since the
    last graph ran make one graph, compiled where it is new (``graph_compilation``, and the recipe
    cache where one is configured) and a cache hit where this process compiled it before."""
    if not _STEP:
        return
    key = ("lazy_graph", _STEP.pop().hexdigest())
    if key not in _GRAPHS:
        _GRAPHS.add(key)
        importlib.import_module("habana_frameworks.torch.hpu.metrics")._count_compilation(LAZY_COMPILE_MICROS, key)


def on_hpu(result, inputs=()):
    """``result``'s tensors as HPU tensors: a new one changes class in place (whoever holds it, an
    autograd gradient included, sees the same object), one of ``inputs`` gets an HPU view."""
    given = {id(leaf) for leaf in _pytree.tree_leaves(inputs) if isinstance(leaf, torch.Tensor)}

    def convert(tensor):
        if isinstance(tensor, HpuTensor) or not isinstance(tensor, torch.Tensor):
            return tensor
        if type(tensor) is torch.Tensor and id(tensor) not in given:
            tensor.__class__ = HpuTensor
            return tensor
        if isinstance(tensor, torch.nn.Parameter):
            return tensor  # a parameter handed back (an in-place op on it): Module.to moves those
        with torch._C.DisableTorchFunctionSubclass():
            return tensor.as_subclass(HpuTensor)

    return _pytree.tree_map_only(torch.Tensor, convert, result)


def on_host(result):
    def convert(tensor):
        if not isinstance(tensor, HpuTensor):
            return tensor
        with torch._C.DisableTorchFunctionSubclass():
            return tensor.as_subclass(torch.Tensor)

    return _pytree.tree_map_only(torch.Tensor, convert, result)


def _retype(tensor, to_hpu: bool) -> None:
    """A tensor given new data takes the data's device (how ``Module.to`` moves parameters)."""
    parameter = isinstance(tensor, torch.nn.Parameter)
    if to_hpu and not isinstance(tensor, HpuTensor):
        tensor.__class__ = HpuParameter if parameter else HpuTensor
    elif not to_hpu and isinstance(tensor, HpuTensor):
        tensor.__class__ = torch.nn.Parameter if parameter else torch.Tensor


def _target_of_to(args, kwargs):
    """The device a ``Tensor.to`` call names (None for a dtype-only call)."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, HpuTensor):
            return HPU
        if isinstance(value, torch.Tensor):
            return value.device
    options = {k: v for k, v in kwargs.items() if k != "copy"}  # not a parse_to argument
    device, _dtype, _non_blocking, _memory_format = torch._C._nn._parse_to(*args[1:], **options)
    return device


def _to(func, args, kwargs):
    source = args[0]
    target = _target_of_to(args, kwargs)
    on_hpu_now = isinstance(source, HpuTensor)
    if target is None or target.type not in ("hpu", "cpu") or (target.type == "cpu" and not on_hpu_now):
        return func(*args, **kwargs)
    host_args = [("cpu" if _is_hpu(a) else a) for a in args[1:] if not isinstance(a, torch.Tensor)]
    host_kwargs = {
        k: ("cpu" if _is_hpu(v) else v) for k, v in kwargs.items() if k != "copy" and not isinstance(v, torch.Tensor)
    }
    _device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*host_args, **host_kwargs)
    if len(args) > 1 and isinstance(args[1], torch.Tensor):
        dtype = args[1].dtype
    crossing = on_hpu_now != (target.type == "hpu")
    if on_hpu_now and target.type == "cpu" and _is_lazy():
        run_graph()
    with torch._C.DisableTorchFunctionSubclass():
        result = torch.Tensor.to(
            source,
            device="cpu",
            dtype=dtype or source.dtype,
            non_blocking=non_blocking,
            copy=crossing or bool(kwargs.get("copy", False)),
            memory_format=memory_format if memory_format is not None else torch.preserve_format,
        )
    return on_hpu(result) if target.type == "hpu" else on_host(result)


class _OnHpu(TorchFunctionMode):
    """Maps ``hpu`` device arguments onto the double's HPU tensors (entered when the bridge loads)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_method(func, "to"):
            return _to(func, args, kwargs)
        if _is_method(func, "cpu") and isinstance(args[0], HpuTensor):
            if _is_lazy():
                run_graph()
            with torch._C.DisableTorchFunctionSubclass():
                return torch.Tensor.clone(args[0]).as_subclass(torch.Tensor)
        if _is_method(func, "numpy") and isinstance(args[0], HpuTensor):
            raise TypeError(
                "can't convert hpu:0 device type tensor to numpy. "
                "Use Tensor.cpu() to copy the tensor to host memory first."
            )
        if _is_data_setter(func):
            func(*args, **kwargs)
            _retype(args[0], isinstance(args[1], HpuTensor))
            return None
        device = kwargs.get("device")
        if _is_hpu(device):
            return on_hpu(func(*args, **{**kwargs, "device": "cpu"}))
        if device is not None and torch.device(device).type == "cpu":
            return on_host(func(*args, **kwargs))  # a method of an HPU tensor asked for a host one
        return func(*args, **kwargs)


_MODE = []


def _refused_to_dynamo(from_real_tensor):
    """Until ``hpu_backend`` is loaded (``_compile``: dynamo then sees HPU tensors as host ones), a
    compile meeting an HPU tensor is told it cannot be faked (torch's own exception): dynamo counts a
    graph break and runs the frame eagerly, where faking a tensor on hpu would abort the CPU build."""

    def from_real(converter, fake_mode, tensor, *args, **kwargs):
        if type(tensor).__module__ == __name__:
            raise fake_tensor.UnsupportedFakeTensorException("the HPU double's tensors are traced by hpu_backend only")
        return from_real_tensor(converter, fake_mode, tensor, *args, **kwargs)

    from_real.original = from_real_tensor
    return from_real


def install() -> None:
    """Enter the mode for the rest of the thread's life (the bridge cannot be unloaded either), keep
    dynamo off HPU tensors until ``hpu_backend`` loads, and let torch's checks of a tensor's exact
    type (``_foreach_supported_types``: fused and foreach optimizers) take the double's HPU tensors
    for the plain ones a Gaudi's are."""
    converter = fake_tensor.FakeTensorConverter
    if not hasattr(converter.from_real_tensor, "original"):
        converter.from_real_tensor = _refused_to_dynamo(converter.from_real_tensor)
    optimizer = importlib.import_module("torch.optim.optimizer")  # torch.optim does not keep the name
    for supported in (_foreach_utils._foreach_supported_types, optimizer._foreach_supported_types):
        supported.extend(kind for kind in (HpuTensor, HpuParameter) if kind not in supported)
    if not _MODE:
        _MODE.append(_OnHpu())
        _MODE[0].__enter__()


def uninstall() -> None:
    """The double's own, for the in-process tests: leave the mode, so later tests run without it."""
    if _MODE:
        _MODE.pop().__exit__(None, None, None)
