"""HPU graphs (exported by hpu only in lazy mode), following the bridge's ``hpu/graphs.py``
(HabanaAI/gaudi-pytorch-bridge, read 2026-11-23). ModuleCacher's capture runs the Python forward
once on the CPU and records the ops it ran (:class:`_Recording`); a replay runs those ops on the new
inputs, not the Python forward: a branch taken on a tensor's value at capture is taken again, no
Python hook fires, and the outputs are written into the same tensors, as on a Gaudi. Every capture
and replay is recorded, so tests see when a new graph would be compiled."""

import copy
import inspect
import weakref

import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from habana_frameworks.torch._calls import record
from habana_frameworks.torch.hpu import metrics
from habana_frameworks.torch.hpu.metrics import _count_compilation
from habana_frameworks.torch.utils.internal import is_lazy


class HPUGraph:
    def capture_begin(self):
        record("graph_capture_begin")

    def capture_end(self):
        record("graph_capture_end")

    def replay(self, asynchronous=False):
        record("graph_replay", asynchronous=asynchronous)


class graph:
    def __init__(self, hpu_graph, stream=None):
        self.hpu_graph = hpu_graph

    def __enter__(self):
        self.hpu_graph.capture_begin()

    def __exit__(self, *exc):
        self.hpu_graph.capture_end()


def make_graphed_callables(
    callables, sample_args, warmups=0, allow_unused_input=False, asynchronous=False, disable_tensor_cache=False
):
    record("make_graphed_callables", warmups=warmups)
    return callables


def _key(args, kwargs):
    shapes = tuple(tuple(a.shape) for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor))
    return shapes, torch.is_autocast_enabled()


def _gradients(module):
    return [parameter.grad for parameter in module.parameters()]


def _cached_forward(module, forward, max_graphs, api):
    """Replays record whether the gradient tensors are the very ones of the previous replay: graphs
    write gradients into fixed tensors, which ``zero_grad(set_to_none=True)`` throws away."""
    seen = []
    previous = []

    def cached(*args, **kwargs):
        key = _key(args, kwargs)
        if key not in seen:
            if max_graphs is not None and len(seen) >= max_graphs:
                record(f"{api}_uncached", shapes=key[0])
                return forward(*args, **kwargs)
            seen.append(key)
            _count_compilation(1000, (api, type(module).__name__, key))
            record(f"{api}_capture", shapes=key[0])
        else:
            current = _gradients(module)
            reused = all(a is not None and a is b for a, b in zip(current, previous)) if previous else None
            previous[:] = current
            record(f"{api}_replay", shapes=key[0], gradients_reused=reused)
        return forward(*args, **kwargs)

    cached.graphs = seen
    return cached


def wrap_in_hpu_graph(module, asynchronous=False, disable_tensor_cache=False, max_graphs=None):
    if module._forward_hooks or module._forward_pre_hooks:
        raise RuntimeError("wrap_in_hpu_graph: module must not have hooks")
    original = module.forward
    module.forward = _cached_forward(module, original, max_graphs, "hpu_graph")
    module.clear_cache = lambda: module.forward.graphs.clear()
    record("wrap_in_hpu_graph", module=type(module).__name__)
    return module


def _argument_names(forward):
    """The bridge maps every call onto the forward's parameter names (arguments go by keyword to
    a copy of the model): positional-only and ``*args`` parameters are refused with an assertion
    when the cacher is applied; ``**kwargs`` is dropped with a printed warning."""
    names = {}
    for name, parameter in inspect.signature(forward).parameters.items():
        assert parameter.kind not in (parameter.POSITIONAL_ONLY, parameter.VAR_POSITIONAL), (
            f"Unsupported argument type : {parameter.kind}"
        )
        if parameter.kind == parameter.VAR_KEYWORD:
            print("[WARNING] Variable keyword arguments will not be supported.")
            continue
        names[name] = parameter.default
    return names


def _input_key(value):
    """The cache key: shapes (not dtypes) of tensors, values of everything else, and the autocast
    state, nested through lists, tuples and dicts."""
    if isinstance(value, dict):
        return tuple((name, _input_key(item)) for name, item in value.items())
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return tuple(_input_key(item) for item in value), torch.is_autocast_enabled()
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.is_contiguous(), torch.is_autocast_enabled()
    return value, torch.is_autocast_enabled()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors(item)]
    return []


class _Input:
    """A recorded op's tensor that a replay takes from its inputs (an argument, parameter or buffer)."""

    def __init__(self, index):
        self.index = index


class _Output:
    """A recorded op's tensor that an earlier op of the replay produced."""

    def __init__(self, op, position):
        self.op, self.position = op, position


class _Recording(TorchDispatchMode):
    """The ops one forward ran, below autograd, as a graph that :meth:`replay` runs on new inputs.

    Each op's tensors are an input (by position), an earlier op's output, or else a constant (a
    tensor the forward held, baked in as the bridge bakes it). A value read to the host
    (``.item()``, ``if tensor:``) is not an op of the graph: what Python did with it at capture is
    what the graph holds. Replayed ops go through autograd as any op does, so a replay's backward is
    that of the recorded ops."""

    def __init__(self, inputs):
        super().__init__()
        self.ops = []  # (op, args, kwargs), tensors as _Input / _Output / constants
        self.outputs = None
        self._names = {id(tensor): _Input(index) for index, tensor in enumerate(inputs)}
        self._alive = list(inputs)  # no id is reused while recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            return result  # read by Python, which decides what else is recorded
        self.ops.append((func, self._named(args), self._named(kwargs)))
        for position, value in enumerate(_pytree.tree_leaves(result)):
            if isinstance(value, torch.Tensor):
                self._names[id(value)] = _Output(len(self.ops) - 1, position)
                self._alive.append(value)
        return result

    def _named(self, tree):
        return _pytree.tree_map_only(torch.Tensor, lambda tensor: self._names.get(id(tensor), tensor), tree)

    def finish(self, outputs) -> None:
        """Name the forward's outputs; the recording keeps no tensor of the capture but constants."""
        self.outputs = self._named(outputs)
        self._alive = self._names = None

    def replay(self, inputs):
        results = []  # per op, the leaves of what it returned

        def value(leaf):
            if isinstance(leaf, _Input):
                return inputs[leaf.index]
            if isinstance(leaf, _Output):
                return results[leaf.op][leaf.position]
            return leaf

        for func, args, kwargs in self.ops:
            output = func(*_pytree.tree_map(value, args), **_pytree.tree_map(value, kwargs))
            results.append(_pytree.tree_leaves(output))
        return _pytree.tree_map(value, self.outputs)


LIVE_CACHERS = weakref.WeakSet()  # the double's own: lets tests see that a cacher was let go


class ModuleCacher(torch.nn.Module):
    """``ModuleCacher(max_graphs)(model=..., inplace=True)``, following the bridge's rules: the
    model's ``forward`` becomes the cacher's and the model keeps ``orig_forward``,
    ``is_hpugraph_tracing``, ``set_iteration_count``, ``capture_start`` and ``capture_end``; only
    training calls with grad are cached, one graph per input key (``_input_key``); a capture calls a
    shallow copy of the model by keyword, refuses DataParallel/DDP models and, unless
    ``allow_unused_input``, raises for a trainable parameter that gets no gradient. The capture runs
    the Python forward once and records its ops; a replay runs the recorded ops on the new inputs
    and the model's parameters and buffers (no Python: no hook fires, a data-dependent branch goes
    as it went at capture) and writes its outputs into the tensors the previous replay of that graph
    returned."""

    def __init__(self, max_graphs=10):
        super().__init__()
        self.max_graphs = max_graphs
        self._graphs = {}  # input key -> (its recording, the outputs its last capture or replay returned)
        LIVE_CACHERS.add(self)

    def __call__(
        self,
        model,
        use_lfu=False,
        inplace=True,
        allow_unused_input=False,
        asynchronous=False,
        have_grad_accumulation=False,
        log_frequency=100,
        verbose=False,
        disable_tensor_cache=False,
        dry_run=False,
    ):
        model.is_hpugraph_tracing = self.is_hpugraph_tracing
        if not inplace:
            model = copy.copy(model)
        self.orig_model = copy.copy(model)
        self.forward_params = _argument_names(self.orig_model.forward)
        self.model = model
        self.allow_unused_input = allow_unused_input
        model.orig_forward = model.forward
        model.forward = self.forward
        model.set_iteration_count = self.set_iteration_count
        model.capture_start = self.capture_start
        model.capture_end = self.capture_end
        record("module_cacher", module=type(model).__name__, max_graphs=self.max_graphs)
        return model

    def is_hpugraph_tracing(self):
        return False

    def set_iteration_count(self, iteration):
        pass

    def capture_start(self):
        pass

    def capture_end(self):
        pass

    def forward(self, *args, **kwargs):
        arguments = dict(self.forward_params)
        arguments.update(zip(self.forward_params, args))
        arguments.update(kwargs)
        key = _input_key(arguments)
        if not (self.model.training and torch.is_grad_enabled() and is_lazy()):
            return self.model.orig_forward(*args, **kwargs)
        if key in self._graphs:
            return self._replay(key, arguments)
        if len(self._graphs) < self.max_graphs:
            return self._capture(key, arguments)
        record("module_cacher_uncached", shapes=_shapes(arguments))
        return self.model.orig_forward(*args, **kwargs)

    def _capture(self, key, arguments):
        assert not isinstance(self.orig_model, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)), (
            "Use DataParallel/DistributedDataParallel only after wrapping with ModuleCacher"
        )
        recording = _Recording(self._inputs(arguments))
        fallbacks = _fallbacks()
        with recording:
            outputs = self.orig_model(**arguments)
        # the bridge's graphs hold device ops only: an op that fell back to the CPU fails the capture
        assert _fallbacks() == fallbacks, "CPU fallback during HPU graph capture"
        recording.finish(outputs)
        trainable = [parameter for parameter in self.orig_model.parameters() if parameter.requires_grad]
        differentiable = [tensor for tensor in _tensors(outputs) if tensor.requires_grad]
        if differentiable and trainable and not self.allow_unused_input:
            gradients = torch.autograd.grad(
                differentiable,
                trainable,
                grad_outputs=[torch.ones_like(tensor) for tensor in differentiable],
                retain_graph=True,
                allow_unused=True,
            )
            if any(gradient is None for gradient in gradients):
                raise RuntimeError(
                    "One of the differentiated Tensors appears to not have been used in the graph. "
                    "Set allow_unused=True if this is the desired behavior."
                )
        self._graphs[key] = recording, outputs
        self._previous_gradients = []
        _count_compilation(1000, ("module_cacher", type(self.orig_model).__name__, key))
        record("module_cacher_capture", shapes=_shapes(arguments))
        return outputs

    def _inputs(self, arguments):
        """What a graph reads: the arguments' tensors, then the model's parameters and buffers."""
        return [*_tensors(arguments), *self.orig_model.parameters(), *self.orig_model.buffers()]

    def _replay(self, key, arguments):
        recording, previous = self._graphs[key]
        outputs = recording.replay(self._inputs(arguments))
        with torch.no_grad():
            for static, new in zip(_tensors(previous), _tensors(outputs)):
                static.data.copy_(new.detach())  # every replay writes into the same output tensors
        self._graphs[key] = recording, outputs
        current = _gradients(self.model)
        previous = self._previous_gradients
        reused = all(a is not None and a is b for a, b in zip(current, previous)) if previous else None
        self._previous_gradients = current
        record("module_cacher_replay", shapes=_shapes(arguments), gradients_reused=reused)
        return outputs


def _fallbacks():
    return dict(metrics.metric_global("cpu_fallback").stats())["TotalNumber"]


def _shapes(arguments):
    return tuple(tuple(tensor.shape) for tensor in _tensors(arguments))
