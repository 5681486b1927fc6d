"""The observers of a census step: a ``TorchDispatchMode`` that counts the step's ops and times them,
collective waits, host reads and matrix dtypes included; torch.profiler's kernel times on CUDA; the
module hooks that find the training model.

On CUDA torch.profiler's CUDA activity (CUPTI) gives the device time of the step's kernels, idle
gaps excluded; on the CPU the clock around each kernel does the same. On HPU (lazy: ops are not run
one by one) the census step starts on an idle device and ends with ``mark_step`` + ``synchronize``;
the wait is the device time the host did not hide. Census steps are slower (they are observed); only
counts and compute time come from them, set against the clean step just before.
"""

from __future__ import annotations

import functools
import sys
import time
import warnings
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autogaudi.core.guard import guarded_call
from autogaudi.core.unit import Scope
from autogaudi.entry.paths import user_location
from autogaudi.measure.trials import median
from autogaudi.optimizations.step_profiler.training_model import RootModules
from autogaudi.watch import steps

# Matrix products: what tensor cores and Gaudi's MME run in bf16 under autocast (forward and backward).
MATRIX_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "convolution", "convolution_backward"}
    | {f"_scaled_dot_product_{kind}_attention" for kind in ("flash", "efficient", "cudnn", "flash_attention_for_cpu")}
)


def thread_clock() -> float:
    """This thread's CPU time (seconds): set against ``steps.clock`` it gives the time the thread was
    off the CPU, waiting for a collective; tests replace both (the ``step_clock`` fixture)."""
    return time.thread_time()


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
        self.overhead = median(calls)
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


class CensusStep:
    """The observers of one census step, started at its first boundary and stopped at its last; none
    of them stays on during the clean steps. Each is registered in a scope as it starts, so one that
    fails to start takes the others off with it."""

    def __init__(self, backend, roots: list, unit):
        self.backend = backend
        self.scope = Scope(unit)
        self.kernels = None
        try:
            self.roots = RootModules(roots, self.scope)
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
