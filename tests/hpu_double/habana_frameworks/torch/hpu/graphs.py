"""HPU graphs (exported by hpu only in lazy mode). Graphs are keyed like the bridge keys them
(input shapes + autocast state); "capture" and "replay" just call the eager forward on the CPU and
are recorded, so tests see when a new graph would be compiled."""

import torch

from habana_frameworks.torch._calls import record
from habana_frameworks.torch.hpu.metrics import _count_compilation


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
            _count_compilation(1000)
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


class ModuleCacher:
    """ModuleCacher(max_graphs)(model=..., inplace=True): caches only training forwards with grad."""

    def __init__(self, max_graphs=10):
        self.max_graphs = max_graphs

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
    ):
        original = model.forward
        cached = _cached_forward(model, original, self.max_graphs, "module_cacher")

        def forward(*args, **kwargs):
            if model.training and torch.is_grad_enabled():
                return cached(*args, **kwargs)
            return original(*args, **kwargs)

        model.forward = forward
        record("module_cacher", module=type(model).__name__, max_graphs=self.max_graphs)
        return model
