"""What the doctor watches while the user's script trains, without changing what it computes.

One :class:`Observer` per diagnosis. It sees:

- every aten op, through a ``TorchDispatchMode`` that calls the op unchanged and notes its name,
  time, dtypes and whether its inputs are *device values* (the model's parameters, the tensors
  passed to it, and everything computed from them: on Gaudi those live on the device, whatever
  device this run uses);
- host reads of device values: ``aten._local_scalar_dense`` (``.item()``, ``float()``, ``bool()`` in
  an ``if``, formatting) in the mode, and ``tolist()`` / ``cpu()`` / ``numpy()`` / ``print`` through
  wrapt wrappers on ``torch.Tensor`` (those do not dispatch an op on a CPU tensor);
- module calls, through torch's global forward hooks: which top-level modules run, with which
  input shapes (of the tensors among their positional arguments, nested or not), which Python
  numbers they are passed (each value a constant of the graph), and whether a read happens inside a
  forward (a graph-capture blocker); keyword arguments are not seen (global hooks are not given
  them); on a module the script compiled the hooks move onto it for its call
  (:mod:`autogaudi.watch.module_hooks`);
- DataLoader construction (batch size, dataset length, ``drop_last``) and the time each batch
  fetch waits;
- optimizer steps, through ``register_optimizer_step_post_hook``: the step boundaries. After
  ``steps`` of them the hook raises :class:`StopDiagnosis`, which ends the script quietly.

Every event is filed under the step it happened in (0 = up to the end of the first optimizer step,
which includes the script's set-up) and under the first stack frame outside torch, wrapt,
autogaudi and the standard library: the user's file:line. Times are read on the step clock
(:func:`autogaudi.watch.steps.clock`), which tests replace to judge given times.
"""

from __future__ import annotations

import linecache
import sys
from collections import Counter, defaultdict

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import dataloader
from torch.utils.weak import WeakIdKeyDictionary

from autogaudi.core.unit import Scope
from autogaudi.diagnosis import gaudi_facts
from autogaudi.entry.paths import user_location
from autogaudi.watch import module_hooks, steps

# Ops whose output shape depends on the values of their input: every new shape a recompilation.
DATA_DEPENDENT_SHAPE_OPS = frozenset(
    {
        "nonzero",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "repeat_interleave",
    }
)
UNSUPPORTED_DTYPES = frozenset(getattr(torch, name) for name in gaudi_facts.UNSUPPORTED_DTYPES)
_HOST_READ_METHODS = {"tolist": "tolist", "cpu": "cpu", "numpy": "numpy", "__repr__": "print"}


class StopDiagnosis(BaseException):
    """Raised from the optimizer step hook once enough steps were seen: a BaseException, so the
    script's own ``except Exception`` does not swallow it."""


def read_kind(location, default: str) -> str:
    """Name a scalar read by its source line: ``.item()``, a condition, or a plain conversion."""
    line = linecache.getline(*location).strip() if location else ""
    if ".item()" in line:
        return "item"
    if line.startswith(("if ", "elif ", "while ", "assert ")) or " if " in line:
        return "condition"
    return default


class _OpWatcher(TorchDispatchMode):
    def __init__(self, observer):
        super().__init__()
        self.observer = observer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        start = steps.clock()
        result = func(*args, **kwargs)
        self.observer.saw_op(func, args, kwargs, result, steps.clock() - start)
        return result


class Observer:
    def __init__(self, steps: int):
        self.max_steps = steps
        self.script = None  # the script's file, where the doctor runs one (not ``-m module``)
        self.steps = 0
        self.step_clocks: list = []  # the step clock at each optimizer step's end
        self.waited = Counter()  # step -> seconds waiting for DataLoader batches
        self.reads = Counter()  # (step, kind, location, inside_forward) -> count
        self.dynamic_ops = Counter()  # (step, op, location) -> count
        self.dtype_ops = Counter()  # (dtype, op, location) -> count
        self.forward_op_seconds = Counter()  # op name -> seconds, inside forwards
        self.shapes = defaultdict(Counter)  # module label -> Counter of input-shape tuples
        self.scalars = defaultdict(Counter)  # (module label, argument path) -> Counter of Python numbers passed
        self.scalar_sites: dict = {}  # (module label, argument path) -> where it was first called with a new value
        self.models: dict = {}  # module label -> module (top-level, with parameters)
        self.call_sites: dict = {}  # module label -> where it was first called with a new shape
        self.loaders: list = []  # (location, batch_size, dataset length or None, drop_last)
        self.autocast_seen = False
        self.optimizers: dict = {}  # id -> each optimizer that stepped
        self.training_inputs: dict = {}  # module label -> the positional inputs of its last call with gradients
        self._device_values = WeakIdKeyDictionary()
        self._depth = 0
        self._reading = False
        self.failure = None  # an error of the observer's own code inside the script's calls: it goes silent
        self._scope = Scope(self)
        self.watcher = _OpWatcher(self)

    @property
    def in_force(self) -> bool:
        return self.failure is None

    def failed_at_run_time(self, error: Exception) -> None:
        self.failure = self.failure or repr(error)

    # -- installation -------------------------------------------------------------------------
    def install(self) -> None:
        self._scope.hook(register_optimizer_step_post_hook, self._after_step)
        self._scope.hook(module_hooks.register_forward_pre_hook, self._before_forward)
        self._scope.hook(module_hooks.register_forward_hook, self._after_forward)
        self._scope.wrap(dataloader.DataLoader, "__init__", self._new_loader)
        self._scope.wrap(dataloader._BaseDataLoaderIter, "__next__", self._next_batch)
        for method, kind in _HOST_READ_METHODS.items():
            self._scope.wrap(torch.Tensor, method, self._host_read_wrapper(kind))

    def uninstall(self) -> None:
        self._scope.close()

    # -- events -------------------------------------------------------------------------------
    def _after_step(self, optimizer, args, kwargs) -> None:
        self.optimizers[id(optimizer)] = optimizer  # kept: the script's may be gone when the findings are made
        self.step_clocks.append(steps.clock())
        self.steps += 1
        if self.steps >= self.max_steps:
            raise StopDiagnosis

    def _is_device_value(self, value) -> bool:
        return isinstance(value, torch.Tensor) and (
            isinstance(value, torch.nn.Parameter) or value in self._device_values
        )

    def saw_op(self, func, args, kwargs, result, seconds: float) -> None:
        name = func.overloadpacket.__name__
        inputs = [value for value in _pytree.tree_leaves((args, kwargs)) if isinstance(value, torch.Tensor)]
        on_device = any(self._is_device_value(value) for value in inputs)
        if on_device:
            for value in _pytree.tree_leaves(result):
                if isinstance(value, torch.Tensor):
                    self._device_values[value] = True
        # inside a forward any read is a graph break, wherever the tensor would live
        if name == "_local_scalar_dense" and not self._reading and (on_device or self._depth):
            self._record_read("scalar")
        if self._depth:
            self.forward_op_seconds[name] += seconds
            bool_mask = name == "index" and any(
                isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
                for index in _pytree.tree_leaves(args[1:])
            )
            if name in DATA_DEPENDENT_SHAPE_OPS or bool_mask:
                label = "index with a boolean mask" if bool_mask else name
                self.dynamic_ops[(self.steps, label, user_location(sys._getframe(1)))] += 1
        dtype = next((value.dtype for value in inputs if value.dtype in UNSUPPORTED_DTYPES), None)
        if dtype is not None:
            self.dtype_ops[(str(dtype).replace("torch.", ""), name, user_location(sys._getframe(1)))] += 1

    def _record_read(self, default_kind: str) -> None:
        location = user_location(sys._getframe(2))
        self.reads[(self.steps, read_kind(location, default_kind), location, self._depth > 0)] += 1

    def _host_read_wrapper(self, kind: str):
        def read(wrapped, instance, args, kwargs):
            if self._reading:
                return wrapped(*args, **kwargs)
            if self._is_device_value(instance):
                self._record_read(kind)
            self._reading = True  # printing a tensor reads it again inside: count the print once
            try:
                return wrapped(*args, **kwargs)
            finally:
                self._reading = False

        return read

    def _before_forward(self, module, args) -> None:
        if self._depth == 0 and any(True for _ in module.parameters()):
            label = f"{type(module).__name__} at {id(module):#x}"
            self.models[label] = module
            leaves, _ = _pytree.tree_flatten_with_path(args)
            shapes = tuple(tuple(value.shape) for _, value in leaves if isinstance(value, torch.Tensor))
            for path, value in leaves:
                if isinstance(value, torch.Tensor):
                    self._device_values[value] = True  # a script on Gaudi moves the model's inputs there
                elif isinstance(value, (int, float)):  # bool included: a flag is a constant too
                    self._saw_scalar((label, f"args{_pytree.keystr(path)}"), value)
            if self.shapes[label] and shapes not in self.shapes[label]:
                self.call_sites.setdefault(label, user_location(sys._getframe(1)))
            self.shapes[label][shapes] += 1
            if torch.is_grad_enabled():  # a training call: the memory projection forecasts its step
                self.training_inputs[label] = args
            self.autocast_seen = self.autocast_seen or _autocast_enabled()
        self._depth += 1

    def _saw_scalar(self, key: tuple, value) -> None:
        values = self.scalars[key]
        if values and value not in values:
            self.scalar_sites.setdefault(key, user_location(sys._getframe(1)))
        values[value] += 1

    def _after_forward(self, module, args, output) -> None:
        self._depth = max(0, self._depth - 1)

    def _new_loader(self, wrapped, instance, args, kwargs):
        wrapped(*args, **kwargs)
        try:
            length = len(instance.dataset)
        except TypeError:  # an IterableDataset without __len__
            length = None
        self.loaders.append((user_location(sys._getframe(1)), instance.batch_size, length, instance.drop_last))

    def _next_batch(self, wrapped, instance, args, kwargs):
        start = steps.clock()
        try:
            return wrapped(*args, **kwargs)
        finally:
            self.waited[self.steps] += steps.clock() - start

    # -- figures ------------------------------------------------------------------------------
    @property
    def measured_steps(self) -> range:
        """The steps that count for per-step figures: all but the first (it includes set-up),
        unless the script made only one."""
        return range(1, self.steps) if self.steps > 1 else range(self.steps)

    def step_seconds(self):
        """Mean seconds per measured step, boundary to boundary, or None."""
        if len(self.step_clocks) < 2:
            return None
        return (self.step_clocks[-1] - self.step_clocks[0]) / (len(self.step_clocks) - 1)


def _autocast_enabled() -> bool:
    for device in ("cpu", "cuda", "hpu"):
        try:
            if torch.is_autocast_enabled(device):
                return True
        except (RuntimeError, TypeError):  # a device type this torch does not know
            continue
    return False
