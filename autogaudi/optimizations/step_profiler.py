"""Where a training step's time goes — host, device or input — measured on a sampled window.

Why: the Gaudi guide's first rule is to profile the host: when the device waits for the host to
issue work (host-bound), graph capture removes that wait; when the device is the bottleneck it buys
nothing and costs compile time. Users profile by hand; autogaudi measures it on every run, cheaply:

``PAIRS`` pairs of steps right after warm-up, each pair a clean step and then a census step:

1. Clean step: timed boundary to boundary (optimizer steps), with the time spent waiting for
   DataLoader batches. Nothing is added to it.
2. Census step: runs under a ``TorchDispatchMode`` that counts the ops the step issues (every aten
   op: forward, backward and optimizer), adds up the time they compute, and records which top-level
   module produced the step (for graph capture). On CUDA torch.profiler's CUDA activity (CUPTI)
   gives the device time of the step's kernels, idle gaps excluded; on the CPU the clock around each
   kernel does the same. On HPU (lazy: ops are not run one by one) the census step starts on an idle
   device and ends with ``mark_step`` + ``synchronize``; the wait is the device time the host did
   not hide. Census steps are slower (they are observed); only counts and compute time come from
   them, set against the clean step just before.

Each census step is set against its own neighbour and the median pair decides (why, with the
measurements that led there: docs/units/step_profiler.md).

Classification (thresholds stated in docs/units/step_profiler.md): input-bound when waiting for
data is at least half of a step; else host-bound when ops compute and waits for collectives
together take less than half of a step (the rest is Python, dispatch and launch overhead: what graph
capture removes); otherwise communication-bound when the collectives hold more of it than the ops,
else device-bound.
The profile goes out as ``Event.STEP_PROFILED`` (graph_capture, channels_last, loader_workers). On a distributed run
each rank measures its own steps and all follow rank 0's classification (a broadcast after the last
census step), so every rank starts the same trials at the same step: ranks that decided apart would wait in
different collectives.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
import warnings
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autogaudi import module_hooks, steps
from autogaudi._paths import short_location, user_location
from autogaudi.events import Event
from autogaudi.guard import guarded_call
from autogaudi.memory import origin
from autogaudi.ranks import rank_zero_choice, several_ranks
from autogaudi.run_length import remaining_steps
from autogaudi.unit import ROUNDING, Scope, Unit

PAIRS = 5
# A majority of PAIRS: where that many pairs read alike (a single process's census), the rest are not taken.
DECIDING_PAIRS = PAIRS // 2 + 1
# The most training steps after warm-up the census waits for another unit's timing: an optimizer that
# steps every step is decided within 13 of its own; one that stopped stepping would be waited for forever.
MEASURING_WAIT_STEPS = 16
# The most of a run the census's one-off (the backend's ``census_one_off_s``) may cost: it starts once
# the run so far, with the steps a framework says are left, is long enough to carry it.
CENSUS_ONE_OFF_SHARE = 0.05
INPUT_BOUND = 0.5
HOST_BOUND = 0.5
# Matrix products: what tensor cores and Gaudi's MME run in bf16 under autocast (forward and backward).
MATRIX_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "convolution", "convolution_backward"}
    | {f"_scaled_dot_product_{kind}_attention" for kind in ("flash", "efficient", "cudnn", "flash_attention_for_cpu")}
)
FP32_MATRIX_SHARE = 0.9  # a step whose matrix products run in float32 at least this often trains in fp32


def thread_clock() -> float:
    """This thread's CPU time (seconds): set against ``steps.clock`` it gives the time the thread was
    off the CPU, waiting for a collective; tests replace both (the ``step_clock`` fixture)."""
    return time.thread_time()


def input_shapes(args, kwargs) -> tuple:
    """What a new graph is built for: tensors' shapes, and the values of plain arguments (an int, a
    flag), on which torch.compile specialises and which ModuleCacher keys its graphs by as well."""

    def key(value):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
        return value if isinstance(value, (bool, int, float, str, type(None))) else type(value).__name__

    return tuple(key(value) for value in args) + tuple((name, key(value)) for name, value in kwargs.items())


def _share(fraction: float) -> str:
    # Census steps run slower than the clean steps, so what they measure can exceed a clean step.
    return "all" if fraction >= 1 else f"{fraction:.0%}"


def classify(waiting: float, busy: float, collective: float = 0.0) -> tuple:
    """(``"input"`` / ``"host"`` / ``"communication"`` / ``"device"``, why) for the fractions of a
    step spent waiting for data, computing ops and waiting for collectives (gradient all-reduce)."""
    if waiting >= INPUT_BOUND:
        return "input", f"waiting for data {waiting:.0%} of each step"
    compute = f"ops compute {_share(busy)}"
    held = f" and collectives hold {_share(collective)}" if collective else ""
    if busy + collective < HOST_BOUND:
        return "host", f"{compute}{held} of each step; issuing the ops (Python, dispatch) takes the rest"
    if collective > busy:
        return "communication", f"waiting for collectives {_share(collective)} of each step, {compute}"
    return "device", f"{compute}{held} of each step"


@dataclasses.dataclass
class StepFigures:
    """What the profiler measured of a step, typed; :meth:`as_dict` gives them under the keys the
    report and a remembered record use (a figure not measured is left out)."""

    ms_per_step: float
    input_wait_fraction: float  # of each clean step, waiting for the DataLoader
    ops_per_step: int
    compute_fraction: float  # of each step, the ops computing (the median census pair)
    compute_fraction_range: list  # [least, most] over the census pairs
    collective_wait_fraction: float | None = None  # where collectives ran
    collectives_without_future_per_step: float | None = None  # where some had no future to wait on
    fp32_matrix_fraction: float | None = None  # where the step ran matrix products

    def as_dict(self) -> dict:
        return {name: value for name, value in dataclasses.asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, figures: dict) -> StepFigures:
        """From a remembered record's figures (keys it does not know are left out)."""
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: value for name, value in figures.items() if name in names})


def pair_shares(clean: list, censuses: list) -> list:
    """Per pair, (busy + collective wait, busy, collective wait) as shares of its clean step, sorted:
    from the clean steps' (seconds, seconds waiting for data) and the census steps' (ops, busy
    seconds, collective wait seconds or None, collectives without a future)."""
    return sorted(
        ((busy_s + (collective_s or 0.0)) / seconds, busy_s / seconds, (collective_s or 0.0) / seconds)
        for (seconds, _waited), (_ops, busy_s, collective_s, _unfutured) in zip(clean, censuses)
    )


def waiting_share(clean: list) -> float:
    """Of the clean steps' time, the share spent waiting for data (a total: workers hand batches over
    in bursts)."""
    return sum(waited for _seconds, waited in clean) / sum(seconds for seconds, _waited in clean)


def settled(clean: list, censuses: list) -> bool:
    """Whether the pairs measured so far already decide what all ``PAIRS`` would: the median pair by
    its share decides, so once ``DECIDING_PAIRS`` (a majority) read alike, on the same side of the
    host-bound line, the pairs still to come cannot move the median across it. (The input share is
    then a total over fewer clean steps, and device against communication, where a single process
    runs collectives at all, is read on the pairs taken.)"""
    if len(censuses) < DECIDING_PAIRS:
        return False
    waiting = waiting_share(clean)
    return len({classify(waiting, busy, collective)[0] for _, busy, collective in pair_shares(clean, censuses)}) == 1


def census_figures(clean: list, censuses: list) -> tuple:
    """The step's figures, and the (input wait, ops computing, collective wait) shares of a step that
    :func:`classify` reads, from the clean steps' (seconds, seconds waiting for data) and the census
    steps' (ops, busy seconds, collective wait seconds or None, collectives without a future)."""
    step_s = statistics.median(seconds for seconds, _waited in clean)
    waiting = waiting_share(clean)
    # The median pair by its sum decides (an odd number of pairs: PAIRS, or DECIDING_PAIRS).
    pairs = pair_shares(clean, censuses)
    _, busy_share, collective_share = pairs[len(pairs) // 2]
    busy = sorted(share for _, share, _ in pairs)
    figures = StepFigures(
        ms_per_step=round(1000 * step_s, 3),
        input_wait_fraction=round(waiting, 3),
        ops_per_step=int(statistics.median(ops for ops, *_ in censuses)),
        compute_fraction=round(min(busy_share, 1.0), 3),
        compute_fraction_range=[round(min(busy[0], 1.0), 3), round(min(busy[-1], 1.0), 3)],
    )
    if any(collective_s is not None for _ops, _busy, collective_s, _unfutured in censuses):
        figures.collective_wait_fraction = round(min(collective_share, 1.0), 3)
    unfutured = statistics.median(unfutured for *_, unfutured in censuses)
    if unfutured:  # their waits are measured up to the next op only (_Census._completion)
        figures.collectives_without_future_per_step = unfutured
    return figures, (waiting, busy_share, collective_share)


# What the census reads of an op, by its overload: a host read of a value (``.item()``), a copy that may
# be one (``.cpu()``), a matrix product, a collective, or nothing ("").
READ, COPY, MATRIX, COLLECTIVE = "read", "copy", "matrix", "collective"
_OP_KINDS: dict = {}  # op overload -> its kind, filled as ops are seen


def _op_kind(func) -> str:
    if func.namespace == "c10d":
        return COLLECTIVE
    name = func.overloadpacket.__name__
    if name == "_local_scalar_dense":
        return READ
    if name == "_to_copy":
        return COPY
    return MATRIX if name in MATRIX_OPS else ""


class _Census(TorchDispatchMode):
    """Counts the ops of a step and, on the CPU, adds up the time their kernels compute (the clock
    around each kernel, less what the clock and the call cost for a trivial op); the Python and
    dispatch overhead between ops is what it leaves out.

    It also measures how long the thread waited for collectives (gloo's all-reduce on the CPU: DDP's
    reducer waits for it between the last backward op and the end of backward, in no op). The
    collective ops (``c10d::``) pass through the mode and hand back their ``Work``, whose future the
    waiting thread wakes on. When a collective in flight at the end of one op has completed by the
    start of the next, the time the thread was off the CPU in between (wall less thread CPU time)
    was spent waiting for it: on a two-rank run the all-reduce, the other rank's lag and, on a busy
    machine, the wait for a core once woken. Graph capture removes none of it; counted as host time
    (as it was), it made a DDP run on two shared cores read host-bound and pay for compile trials
    that could not help. (The future's ``done()`` is asked: a callback on it needs the GIL, which
    the woken thread holds, and stamped the completion after the next op had started; gloo's
    ``Work.is_completed()`` turns true only after the future has woken the thread, and missed one
    wait in six.)"""

    @classmethod
    def _should_skip_dynamo(cls):
        # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable, which imports dynamo at
        # its first call: 1.0-1.2 s on the 2-core CPU, three times a 1.5 s script's whole run. Where
        # dynamo was never imported, nothing can be compiling: this class goes unwrapped, and
        # _DynamoSafeCensus (wrapped) is used once dynamo is loaded (docs/units/step_profiler.md).
        return False

    def __init__(self):
        super().__init__()
        # The census is the guard's owner of its own bookkeeping: it runs inside every op of the user's
        # step, where the unit cannot be reverted (that would leave the mode from inside its own
        # handler). A census whose bookkeeping raised passes every op straight through, and the unit
        # fails with that error at the step's end (:meth:`StepProfiler._after_step`).
        self.failure = None
        self.ops = 0
        self.cpu_seconds = 0.0
        self.overhead = 0.0
        self.collectives = 0
        self.collective_seconds = 0.0
        self.without_future = 0  # collectives whose Work has no future (see _completion)
        self._in_flight: list = []  # a done() per collective not yet seen completed
        self._returns = 0  # times the thread came back to the census after an op (or at the step's end)
        self._gap = None  # (wall, thread CPU time) when an op ended with a collective in flight
        self.host_reads = Counter()  # (device type, user's (file, line) or None) -> reads of a value
        self.matrix_ops = Counter()  # input dtype -> matrix products

    @property
    def in_force(self) -> bool:
        return self.failure is None

    def failed_at_run_time(self, error: Exception) -> None:
        self.failure = self.failure or error

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return guarded_call(self, functools.partial(self._count, func), func, args, kwargs or {})

    def _count(self, func, call, args, kwargs):
        """The op, timed, and what it tells: host reads, matrix products, collectives in flight. Runs
        around every op of a census step: what it reads of the op is looked up once per op
        (:func:`_op_kind`), and the collectives' bookkeeping only while one is in flight."""
        self.ops += 1
        self.close_gap()
        start = steps.clock()
        result = call(*args, **kwargs)
        end = steps.clock()
        self.cpu_seconds += end - start
        kind = _OP_KINDS.get(func)
        if kind is None:
            kind = _OP_KINDS[func] = _op_kind(func)
        if kind == COLLECTIVE:
            self._watch(result)
        elif kind:
            self._note_op(kind, args, kwargs)
        if self._in_flight:
            self._drop_completed()
            if self._in_flight:
                self._gap = (end, thread_clock())
        return result

    def _note_op(self, kind: str, args, kwargs) -> None:
        """Host reads of a tensor's value (``.item()``, ``float()``, ``bool()``, ``.cpu()``) with the
        user's line that made them, and the dtype each matrix product ran in."""
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is None:
            return
        if kind == MATRIX:
            self.matrix_ops[source.dtype] += 1
        elif kind == READ or (source.device.type != "cpu" and str(kwargs.get("device")) == "cpu"):
            self.host_reads[(source.device.type, user_location(sys._getframe(2)))] += 1

    def _watch(self, result) -> None:
        from torch._C._distributed_c10d import Work  # only reached on builds with torch.distributed

        for value in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(value, torch.ScriptObject) and value._type().qualified_name().endswith("c10d.Work"):
                self.collectives += 1
                self._in_flight.append(self._completion(Work.unbox(value)))

    def _completion(self, work):
        """What says whether ``work`` has completed: its future's ``done``. Some backends' Work has no
        future (gloo's reduce-scatter, FSDP2's gradient reduction, raises "Work::getFuture not
        implemented", and its ``is_completed()`` stays False even after ``wait()``): such a Work
        counts as completed once the thread is back after the op that issued it. That is exact where
        the caller waits at once (torch.distributed does for every call without ``async_op=True``,
        FSDP2's reduce-scatter among them); the wait on a handle kept and waited later is missed."""
        try:
            return work.get_future().done
        except RuntimeError:
            self.without_future += 1
            issued = self._returns
            return lambda: self._returns > issued

    def _drop_completed(self) -> bool:
        """Drops the collectives that have completed from those in flight; True if any had."""
        in_flight = len(self._in_flight)
        self._in_flight = [done for done in self._in_flight if not done()]
        return len(self._in_flight) < in_flight

    def close_gap(self) -> None:
        """Ends the time since the last op, if a collective was in flight then."""
        self._returns += 1
        if self._gap is None:
            return
        (began, cpu_began), self._gap = self._gap, None
        off_cpu = steps.clock() - began - (thread_clock() - cpu_began)
        if self._drop_completed():
            self.collective_seconds += max(0.0, off_cpu)

    def calibrate(self, repeats: int = 100) -> None:
        """The cost of a trivial op: the median call, so that a preempted call does not count."""
        a, b = torch.ones(1), torch.ones(1)
        calls = []
        for _ in range(repeats):
            before = self.cpu_seconds
            torch.add(a, b)
            calls.append(self.cpu_seconds - before)
        self.overhead = statistics.median(calls)
        self.ops, self.cpu_seconds = 0, 0.0

    def busy_seconds(self) -> float:
        return max(0.0, self.cpu_seconds - self.ops * self.overhead)


class _DynamoSafeCensus(_Census):
    """The census with its dispatch handler kept out of dynamo, for processes that loaded it."""

    __torch_dispatch__ = _Census.__torch_dispatch__  # in this class's own namespace: torch wraps it

    @classmethod
    def _should_skip_dynamo(cls):
        return True


def new_census() -> _Census:
    return _DynamoSafeCensus() if "torch._dynamo" in sys.modules else _Census()


class _KernelTimes:
    """CUDA: the device time of the step's kernels, from torch.profiler's CUDA activity (CUPTI).
    Event pairs around each op were tried first and measured the host's launch latency too
    (170% of a host-bound step on an H100), since an idle device stamps the start event at once."""

    def __init__(self):
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        self.profiler.__enter__()

    def stop(self) -> None:
        """Ends the profiler session; ``seconds`` is the device time of the step's kernels."""
        torch.cuda.synchronize()
        with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": not the user's
            warnings.simplefilter("ignore")
            self.profiler.__exit__(None, None, None)
        self.seconds = (
            sum(
                event.time_range.elapsed_us()
                for event in self.profiler.events()
                if event.device_type == torch.autograd.DeviceType.CUDA
            )
            / 1e6
        )


class _RootModules:
    """The outermost modules called during a census step (what produced the loss), added to
    ``called``, how often each was called in the step (``calls``, by identity: a module called
    again while an earlier output is still in use cannot replay graphs into static outputs), and the
    shapes of each one's first positional inputs (``inputs``, by identity: part of the key runs are
    remembered by)."""

    def __init__(self, called: list, scope):
        self.depth = 0
        self.called = called
        self.calls: dict = {}
        self.inputs: dict = {}
        scope.hook(module_hooks.register_forward_pre_hook, self._enter)
        scope.hook(module_hooks.register_forward_hook, self._leave)

    def _enter(self, module, args):
        if self.depth == 0:
            if not any(module is seen for seen in self.called):
                self.called.append(module)
            self.calls[id(module)] = self.calls.get(id(module), 0) + 1
            self.inputs.setdefault(id(module), input_shapes(args, {}))
        self.depth += 1

    def _leave(self, _module, _args, _output):
        self.depth = max(0, self.depth - 1)


class _CensusStep:
    """The observers of one census step, started at its first boundary and stopped at its last; none
    of them stays on during the clean steps. Each is registered in a scope as it starts, so one that
    fails to start takes the others off with it."""

    def __init__(self, backend, roots: list, unit):
        self.backend = backend
        self.scope = Scope(unit)
        self.kernels = None
        try:
            self.roots = _RootModules(roots, self.scope)
            if backend.name == "hpu":
                backend.synchronize()  # the step's device time starts on an idle device
            if backend.name == "cuda":
                self.kernels = _KernelTimes()
                self.scope.add(self.kernels.stop)
            self.census = new_census()
            self.census.__enter__()
            self.scope.add(self._leave_census)
            self.census.calibrate()
        except BaseException:
            self.scope.close()
            raise

    def stop(self) -> tuple:
        """(ops issued, seconds the device was busy, seconds waited for collectives, collectives whose
        Work had no future) of the step. The wait is None where the step ran no collective, and on
        CUDA and HPU: there collectives run on the device (NCCL kernels, HCCL), and their time is in
        the device's already."""
        self.census.close_gap()
        self.abandon()
        if self.census.failure is not None:  # out of the mode now: the unit can fail and be reverted
            raise self.census.failure
        if self.backend.name == "hpu":
            self.backend.mark_step()
            issued = steps.clock()
            self.backend.synchronize()
            return self.census.ops, steps.clock() - issued, None, 0
        if self.backend.name == "cuda":
            return self.census.ops, self.kernels.seconds, None, 0
        return (
            self.census.ops,
            self.census.busy_seconds(),
            self.census.collective_seconds if self.census.collectives else None,
            self.census.without_future,
        )

    def _leave_census(self) -> None:
        self.census.__exit__(None, None, None)

    def abandon(self) -> None:
        """Takes the observers off (newest first: the dispatch mode, the profiler, the hooks)."""
        self.scope.close()


def training_root(roots: list, optimizer):
    """The root module that owns most of the optimizer's parameters (without an optimizer: of the
    parameters the step gave a gradient), or None."""
    if optimizer is not None:
        optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    else:
        optimized = {id(p) for module in roots for p in module.parameters() if p.grad is not None}
    best, best_count = None, 0
    for module in roots:
        count = sum(p.numel() for p in module.parameters() if id(p) in optimized)
        if count > best_count:
            best, best_count = module, count
    return best


def model_name(model) -> str:
    """The class of the model the script wrote: a ``torch.compile(model)`` of its own is named by the
    module it compiled. The profile's model stays the ``OptimizedModule``, the module the script calls
    (the units that would compile or hold that call see it compiled by the script)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    return type(model).__name__


def _weak(value):
    return None if value is None else weakref.ref(value)


class StepProfile:
    """The result: the bound, why, the figures (``measured``, a :class:`StepFigures`), the module
    that produced the step's loss (inside DDP: graphs go inside it, its hooks stay outside) and how
    often it was called per step. The model and optimizer are held weakly: the profile must not keep
    the user's objects alive."""

    def __init__(
        self,
        bound: str,
        why: str,
        measured: StepFigures,
        root,
        optimizer,
        calls_per_step: int = 1,
        inputs=(),
        remembered=None,
    ):
        self.bound = bound
        self.why = why
        self.measured = measured
        if isinstance(root, torch.nn.parallel.DistributedDataParallel):
            root = root.module
        self._model = _weak(root)
        self._optimizer = _weak(optimizer)  # the optimizer whose step ended the census step
        self.calls_per_step = calls_per_step
        self.inputs = inputs  # the shapes of the model's positional inputs in the profiled step
        self.remembered = remembered  # the record of an earlier run this profile was taken from, or None

    def as_record(self) -> dict:
        """What a later run with the same set-up, model and inputs takes as its profile."""
        return {
            "bound": self.bound,
            "why": self.why,
            "figures": self.measured.as_dict(),
            "calls_per_step": self.calls_per_step,
        }

    @property
    def model(self):
        return self._model() if self._model is not None else None

    @property
    def optimizer(self):
        return self._optimizer() if self._optimizer is not None else None


class StepProfiler(Unit):
    reasons = {
        "warming_up": "waiting for {steps} warm-up steps",
        "others_measuring": "waiting while another unit times its own work inside the steps ({units})",
        "census_waits": "the census's device timing costs about {one_off_s:g} s once on {backend}; it starts once "
        "the run has lasted {after_s:g} s, so that a shorter run pays nothing for it",
        "remembered_profile": "{bound}-bound, as measured in run {run} on {date} with the same script, model "
        "and inputs: {why}",
        **{f"{bound}_bound": f"{bound}-bound: {{why}}" for bound in ("input", "host", "communication", "device")},
        "follows_rank_zero": "this rank measured {bound}-bound ({why}); every rank follows rank 0",
        "hpu_lazy_device_time": "HPU lazy: the device time is the wait in synchronize() after mark_step, which also "
        "drains the host's graph building; a host-bound run can read device-bound",
        "host_reads": "{per_step:g} host read(s) of device values per step (.item(), float(), bool(), .cpu()) at "
        "{sites}: each makes the host wait until the device has finished the step, so the next step cannot be "
        "queued behind it; read every N steps, or accumulate on the device",
        "fp32_products": "device-bound, and {share:.0%} of the step's matrix products run in float32: bf16 autocast "
        'runs them on the matrix units; try torch.autocast(device_type="{device}", dtype=torch.bfloat16) around '
        "the forward and the loss, and compare the loss curve",
    }
    acts_on = (
        "training steps and batch fetches (the session's step watcher)",
        "global module forward hooks and a TorchDispatchMode, during three to five census steps",
    )
    exact_when = "the script itself marks a step after each optimizer step"  # in HPU lazy mode

    @classmethod
    def numerics_on(cls, backend) -> tuple:
        # In HPU lazy mode a census step ends with mark_step, cutting the graph where the script may
        # not (by reading). Elsewhere it only observes: the census runs the step's own ops.
        return (ROUNDING,) if backend.name == "hpu" and backend.is_lazy else ()

    def apply(self) -> None:
        self.profile = None
        self._step_began = None
        self._waited = 0.0
        self._clean: list = []  # (seconds, seconds waiting for data) of each clean step
        self._census_step = None
        self._censuses: list = []  # what _CensusStep.stop() gave for each census step
        self._roots: list = []
        self._calls: list = []  # calls of each root module (by id) in each census step
        self._reads: list = []  # host reads (device type, where) of each census step
        self._matrix_ops = Counter()  # input dtype -> matrix products, over the census steps
        self._inputs: dict = {}  # root module (by id) -> the shapes of its first inputs
        self._done = 0
        self._recall = None  # None: not yet looked; a Scope: identifying the model; False: done or none
        self._identify = None  # the root modules of the step that identifies the model
        self._known_end = None  # the training step a framework says the run ends at (looked up once)
        self._listening = self.scope.child()  # the step and batch listeners, closed once classified
        self.on(Event.TRAINING_STEP, self._after_step, self._listening)
        self.on(Event.BATCH_FETCHED, self._after_batch, self._listening)
        self.on_revert(self._abandon_census)
        self.because("warming_up", steps=self.options.warmup_steps)

    def _after_batch(self, _iterator, _batch, waited: float) -> None:
        if self._step_began is not None:
            self._waited += waited

    def _after_step(self, optimizer) -> None:
        """Warm-up ends at ``done == 0``; odd ``done`` ends a clean step, even ``done`` a census step.
        Training steps are whole iterations (the session paces them on one optimizer, or on backward
        passes where no optimizer steps)."""
        if not self.session.steps.warmed_up:
            return
        if self._recall is not False and self._recalled(optimizer):
            return
        if self._done == 0 and (self._census_waits() or self._others_measuring()):
            return
        done, self._done = self._done, self._done + 1
        if done % 2:
            self._clean.append((steps.clock() - self._step_began, self._waited))
            self._step_began = None
            self._census_step = _CensusStep(self.backend, self._roots, self)
            return
        if done:
            census_step, self._census_step = self._census_step, None  # a failing stop is not undone twice
            self._censuses.append(census_step.stop())
            self._calls.append(census_step.roots.calls)
            self._inputs = {**census_step.roots.inputs, **self._inputs}
            self._reads.append(census_step.census.host_reads)
            self._matrix_ops.update(census_step.census.matrix_ops)
        if done == 2 * PAIRS or (done and not several_ranks() and settled(self._clean, self._censuses)):
            self._finish_census(optimizer)
        else:
            self._waited, self._step_began = 0.0, steps.clock()

    def _census_waits(self) -> bool:
        """Whether the census's one-off would still be more than ``CENSUS_ONE_OFF_SHARE`` of the run's
        length as known so far (its wall time, and the steps a framework says are left at this pace).
        A unit forced or put on trial by the user is the user taking its one-offs: no wait then. Nor
        with several ranks: each rank's clock would end the wait at its own step, and the census ends
        in a broadcast every rank must reach at the same step."""
        one_off = self.backend.census_one_off_s
        if not one_off or self.options.force or self.options.trial or several_ranks():
            return False
        watcher = self.session.steps
        if self._known_end is None:
            remaining = remaining_steps()
            self._known_end = watcher.steps + remaining[0] if remaining is not None else 0
        run_s = steps.clock() - watcher.began
        if watcher.timed is not None and self._known_end > watcher.steps:
            timed_steps, timed_s = watcher.timed
            run_s += (self._known_end - watcher.steps) * timed_s / timed_steps
        after_s = one_off / CENSUS_ONE_OFF_SHARE
        if run_s >= after_s:
            return False
        if self.reason.code != "census_waits":
            self.because("census_waits", one_off_s=one_off, backend=self.backend.name, after_s=after_s)
        return True

    def _others_measuring(self) -> bool:
        """Whether another unit times work of its own inside the steps (fused_optimizer's update
        against torch's, on copies): a census step would count that work as the step's, and its
        dispatch mode would slow what the unit times. The census starts after it."""
        if self.session.steps.steps >= self.options.warmup_steps + MEASURING_WAIT_STEPS:
            return False
        measuring = [unit.name for unit in self.session.measuring_units()]
        if measuring and self.reason.code != "others_measuring":
            self.because("others_measuring", units=", ".join(measuring))
        return bool(measuring)

    def _abandon_census(self) -> None:
        if self._census_step is not None:
            self._census_step.abandon()

    def _finish_census(self, optimizer) -> None:
        figures, shares = census_figures(self._clean, self._censuses)
        measured = classify(*shares)
        bound, why = rank_zero_choice(measured)
        if bound != measured[0]:
            self.note("follows_rank_zero", bound=measured[0], why=measured[1])
        root = training_root(self._roots, optimizer)
        # ``is not None``: a module's truth is its length where it has one (an empty Sequential is
        # false; torch.compile's OptimizedModule asks the module it compiled, and raises without one).
        calls = max((step_calls.get(id(root), 0) for step_calls in self._calls), default=0) if root is not None else 0
        inputs = self._inputs.get(id(root), ())
        self.profile = StepProfile(bound, why, figures, root, optimizer, calls_per_step=calls, inputs=inputs)
        self.figures.update(bound=bound, profiled_at_step=self.session.steps.steps, **figures.as_dict())
        self.because(f"{bound}_bound", why=why)
        if root is not None:
            self.figures["model"] = model_name(self.profile.model)
            self.figures["model_calls_per_step"] = calls
        if self.backend.name == "hpu" and self.backend.is_lazy:
            # The bridge's synchronize() marks a step and drains the host pipeline before it waits
            # (hpu/csrc/bindings.cpp, as read for issue 23): what is timed as device work includes the
            # host's graph building. Unverified on hardware; said rather than corrected.
            self.note("hpu_lazy_device_time")
        self._advise(root)
        self._publish()

    def _publish(self) -> None:
        self._roots, self._calls = [], []  # hold none of the user's objects
        self.moment("profiled", bound=self.profile.bound)
        self.close_scope(self._listening)  # classified once: no more work on every step and batch
        self.session.events.emit(Event.STEP_PROFILED, self.profile)
        self.session.check_settled()

    def _recalled(self, optimizer) -> bool:
        """Where earlier runs with this set-up left decisions, the first step after warm-up runs with
        forward hooks only, to find the training model and its inputs; with an entry for them the
        remembered profile is published at once, and no census step runs (True). Otherwise
        profiling starts from here (False)."""
        memory = self.session.memory
        if self._recall is None:
            if memory is None or not memory.has_entries():
                self._recall = False
                return False
            self._recall = self.scope.child()
            self._identify = _RootModules(self._roots, self._recall)
            return True
        self.close_scope(self._recall)
        self._recall = False
        identify, self._identify = self._identify, None
        root = training_root(self._roots, optimizer)
        self._roots = []
        inputs = identify.inputs.get(id(root), ()) if root is not None else ()
        model = root.module if isinstance(root, torch.nn.parallel.DistributedDataParallel) else root
        entry = memory.recall(model, inputs)
        if entry is None:
            return False
        record = entry["profile"]
        calls = identify.calls.get(id(root), 0)
        self.profile = StepProfile(
            record["bound"],
            record["why"],
            StepFigures.from_dict(record["figures"]),
            root,
            optimizer,
            calls,
            inputs,
            remembered=record,
        )
        self.figures.update(
            bound=record["bound"],
            profiled_at_step=self.session.steps.steps,
            **record["figures"],
            remembered_from_run=record["run"],
        )
        self.figures.update(model=model_name(self.profile.model), model_calls_per_step=calls)
        self.because("remembered_profile", bound=record["bound"], why=record["why"], **origin(record))
        self._publish()
        return True

    def _advise(self, root) -> None:
        """Figures from what the census steps saw, and where they cost time on this backend, what the
        user could change (autogaudi changes neither: both change what the script computes or prints)."""
        device = next((p.device.type for p in root.parameters()), None) if root is not None else None
        device = device or self.backend.device_type  # reads of the training device's values only
        on_device = [
            Counter({where: count for (kind, where), count in reads.items() if kind == device}) for reads in self._reads
        ]
        per_step = statistics.median(sum(reads.values()) for reads in on_device)  # Counter.total(): 3.10+
        sites = sum(on_device, Counter())
        sites.pop(None, None)  # reads made outside any user frame
        self.figures["host_reads_per_step"] = per_step
        where = [f"{short_location(site)} ({count / len(self._reads):g}/step)" for site, count in sites.most_common(3)]
        if where:
            self.figures["host_read_sites"] = where
        if per_step >= 1 and self.backend.host_runs_ahead:
            self.recommend(
                "host_reads",
                per_step=per_step,
                sites=", ".join(where),
                do=f"read device values every N steps, not every step, at {where[0] if where else 'the script'}",
            )
        matrix = sum(self._matrix_ops.values())
        if not matrix:
            return
        fp32 = self._matrix_ops[torch.float32] / matrix
        # Also in the profile: what mixed_precision reads, remembered with it for a later run.
        self.figures["fp32_matrix_fraction"] = self.profile.measured.fp32_matrix_fraction = round(fp32, 3)
        if fp32 >= FP32_MATRIX_SHARE and self.profile.bound == "device" and self.backend.fast_bf16():
            self.recommend(
                "fp32_products",
                share=fp32,
                device=self.backend.device_type,
                do=f"--precision auto ({fp32:.0%} of the matrix products run in float32)",
                # bf16 matrix units run about twice the float32 rate: half the float32 matrix share
                saves=round(self.profile.measured.compute_fraction * fp32 / 2, 3),
            )
