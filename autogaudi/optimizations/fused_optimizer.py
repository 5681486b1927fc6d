"""Adam, AdamW and SGD as one fused kernel per step instead of a loop of small ops per parameter.

Why: the stock optimizers launch several ops per parameter tensor every step; a fused kernel does
the whole update in one pass, which is what the Gaudi guide (hpex ``FusedAdamW``/``FusedSGD``) and
the Hugging Face guide (``fused=True``) recommend.

How, per backend:
- CUDA and CPU: the user's optimizer is built exactly as written, and each of its steps sets
  ``fused=True`` in its groups for the time of the update (torch's own kernel). Outside a step the
  object is the script's, so ``state_dict()``, ``copy.deepcopy`` and pickles carry its settings.
- HPU: the user's ``torch.optim`` object is built as written and keeps every user-visible aspect
  (type, ``param_groups``, ``state``, schedulers, ``add_param_group``); its ``step`` runs an hpex
  fused optimizer that shares that state and mirrors each of the user's groups in a group of its
  own (its extra settings added, empty groups left out), with every hyperparameter passed
  explicitly (FusedAdamW's own defaults, eps 1e-6 and weight_decay 0.0, differ from torch's). The
  mirrors persist from step to step: the bridge's FusedAdamW counts steps in its group
  (``group["step"]``), and a mirror rebuilt each step made every step its first (a constant
  learning rate of sqrt(1-beta2)/(1-beta1) times the user's). The user's step hooks fire once.

torch refuses some tensors only inside the fused step (sparse gradients, complex or integer
parameters, other devices, DTensors under SGD), after building the optimizer without complaint: they
are checked before each update (after the closure, whose gradients count) and at construction, and
such an optimizer runs torch's own unfused step from then on. If the fused step raises anyway, the
group it raised on (torch checks a group before updating it) and the groups after it run unfused,
its counters put back, and the optimizer stays unfused.

Numerics: one fused update rounds otherwise than torch's per-op one. In the run's first
``MEASURED_STEPS`` fused steps torch's own unfused step runs beside it on copies of the parameters,
gradients and state (where they fit in a quarter of the memory free), and the largest relative
parameter difference goes to the report: the script's tensors are not touched.

Speed: where the host waits for each op (CPU), the two updates are timed on those copies, in the
fused steps after the first (which allocates the state in both) until each has ``TIMED_STEPS``
samples, or ``SETTLED_AFTER`` where the two sets do not overlap (each timed step costs a copy and
a second update). The fused update stays only where it is faster by the trials' rule (:func:`autogaudi.trials.faster`,
on the medians, a tie put back); else the optimizer goes back to the script's own kernels from its
next step on, its ``step`` counters in the unfused format. Then no more copies are made. Where the
host runs ahead of the device, timing would take a synchronisation the run would not have: the
fused update stays untimed.

Checkpoints and copies stay plain PyTorch both ways: ``state_dict()``, ``deepcopy`` and pickles carry
the user's own ``fused`` value and torch's per-parameter tensor ``step`` (on HPU taken from the group
counter); ``load_state_dict()`` accepts a plain checkpoint and the counters continue from its steps.
Skipped per optimizer (with the reason) when the script chose ``fused``/``foreach`` itself, for
subclasses (their ``step`` may be their own), and for arguments the fused kernel lacks
(amsgrad, maximize, differentiable, … on HPU). ``disable()`` gives every optimizer back to torch's
own step, its state in torch's format.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import statistics
import sys
import weakref

import torch
from torch.optim.optimizer import _foreach_supported_types, _get_scalar_dtype
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from autogaudi import numerics, steps, trials
from autogaudi.events import Event
from autogaudi.ranks import several_ranks
from autogaudi.unit import ROUNDING, Unit

FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
# The classes whose torch kernel DTensor (FSDP2's parameters) has a sharding rule for (_fused_adam_,
# _fused_adamw_); torch 2.13 has none for _fused_sgd_: SGD over DTensors raises NotImplementedError.
TAKES_DTENSOR = (torch.optim.Adam, torch.optim.AdamW)
# The run's first fused steps, each set beside torch's unfused step from the same state (on copies):
# how far one fused update rounds from torch's own, for the report (numerics_measured).
MEASURED_STEPS = 3
# The updates timed per optimizer, fused against unfused, before deciding: as many as a trial's arm.
TIMED_STEPS = 2 * trials.BLOCK * trials.ROUNDS
# Updates timed each way after which two sets that do not overlap decide at once: every fused update
# faster than every unfused one by the trials' rule, or none of them (by chance, 1 ordering in 70).
SETTLED_AFTER = 4


def user_hyperparameters(optimizer_class, args, kwargs) -> dict:
    """Every hyperparameter the user's constructor call means, defaults included."""
    bound = inspect.signature(optimizer_class.__init__).bind(None, *args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    for name in ("self", "params"):
        values.pop(name, None)
    return values


def unfusable_tensor(optimizer, dtensor_refused_by=None):
    """``(code, values)`` for the first tensor of ``optimizer`` its fused kernel would refuse at the
    step (torch's own criteria: ``_default_to_fused_or_foreach`` and the kernels' checks), or None."""
    devices = _get_fused_kernels_supported_devices()
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if dtensor is not None and isinstance(param, dtensor):
                if dtensor_refused_by:
                    return "dtensor_parameters", {"kernel": dtensor_refused_by}
            elif type(param) not in _foreach_supported_types:
                return "parameter_type", {"type": type(param).__name__}
            if param.device.type not in devices:
                return "parameter_device", {"device": param.device.type, "devices": "/".join(devices)}
            if not torch.is_floating_point(param):
                return "parameter_dtype", {"dtype": str(param.dtype)}
            if param.grad is not None and param.grad.layout is not torch.strided:
                return "sparse_gradients", {"layout": str(param.grad.layout)}
    return None


@contextlib.contextmanager
def _fused_flag(group):
    """``fused=True`` in ``group`` for the time of torch's step, where the script left it unset."""
    if group.get("fused") is not None:
        yield
        return
    group["fused"] = True
    try:
        yield
    finally:
        group["fused"] = None


def _step_counters(optimizer, group) -> dict:
    """Adam's ``step`` counter of each of ``group``'s parameters that has one, with its version."""
    counters = {}
    for param in group["params"]:
        step = optimizer.state.get(param, {}).get("step")
        if torch.is_tensor(step):
            counters[id(param)] = (step, step._version)
    return counters


def _rewind(optimizer, group, counters) -> None:
    """Put back the counters a fused step that raised had advanced: it counts before its kernel
    runs (and takes one back itself on a step GradScaler skips), the unfused step counts again."""
    for param in group["params"]:
        step = optimizer.state.get(param, {}).get("step")
        if torch.is_tensor(step):
            before, version = counters.get(id(param), (None, 0))  # a counter created in this step: 0
            if step._version != (version if before is step else 0):
                step.sub_(1)


def _fused_format_steps(optimizer) -> None:
    """Adam's per-parameter ``step`` where the fused kernel wants it, float32 on the parameter's
    device: torch puts it there when it loads a checkpoint into a fused optimizer, and this one's
    groups say the script's ``fused`` (a plain checkpoint keeps it on the CPU)."""
    for param, state in optimizer.state.items():
        step = state.get("step")
        if torch.is_tensor(step):
            state["step"] = step.to(dtype=torch.float32, device=param.device)


def _unfused_format_steps(optimizer) -> None:
    """Adam's per-parameter ``step`` where torch's unfused step keeps it (its ``_init_group``): on the
    CPU unless the group is capturable, in the default float dtype, as a run never fused has it."""
    for group in optimizer.param_groups:
        dtype = _get_scalar_dtype(is_fused=group.get("fused"))
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            step = state.get("step")
            if torch.is_tensor(step):
                state["step"] = step.to(dtype=dtype, device=param.device if group.get("capturable") else "cpu")


@dataclasses.dataclass
class UpdateTimes:
    """One optimizer's updates timed (seconds): torch's unfused one on the copies, the fused one."""

    unfused: list = dataclasses.field(default_factory=list)
    fused: list = dataclasses.field(default_factory=list)
    decided: bool = False

    def apart(self) -> bool:
        """Whether the trials' rule says the same of every fused update against every unfused one:
        the medians can then only say it too."""
        return trials.faster(max(self.fused), min(self.unfused)) or not trials.faster(
            min(self.fused), max(self.unfused)
        )


def _raw_step(optimizer):
    """The optimizer class's ``step`` without torch's hook layer (``profile_hook_step``)."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step)


class FusedOptimizer(Unit):
    numerics = (ROUNDING,)  # one fused update rounds otherwise than torch's per-op one (measured on CPU)
    reasons = {
        "torch_fused": "torch fused=True kernels",
        "hpex": "hpex fused optimizers",
        # why one optimizer runs unfused (figure kernel_refusals, and the notes)
        "parameter_type": "a parameter is a {type}, which the fused kernel does not take",
        "parameter_device": "a parameter is on {device}; the fused kernel runs on {devices}",
        "parameter_dtype": "a parameter is {dtype}; the fused kernel takes floating-point tensors only",
        "dtensor_parameters": "its parameters are DTensors (FSDP2), which {kernel} does not take",
        "sparse_gradients": "a gradient is sparse ({layout}), which the fused kernel does not take",
        "fused_step_raised": "the fused step raised {error!r}",
        # notes: an optimizer left unfused, why (the code above in refusal, where the kernel refused)
        "optimizer_kept": "{optimizer} kept as is: {why}",
        "optimizer_unfused": "{optimizer} runs unfused from its next step on: {why}",
        # the fused update timed slower than torch's unfused one (note; the unit's reason once none is fused)
        "fused_slower": "fused update measured slower: put back ({optimizer}: {fused} ms against {unfused} ms "
        "unfused, medians of {steps} updates)",
        "not_timed_several_ranks": "the fused update kept untimed: with several ranks each would decide on its own "
        "timings, and replicas updated by different kernels would drift apart",
        # notes: the rounding the fused update adds was not measured (the report says "not measured")
        "rounding_not_measured_memory": "rounding not measured: a copy of {optimizer}'s parameters, gradients "
        "and state ({gb:.2f} GB) would take more than {share:.0%} of the memory free",
        "rounding_not_measured_dtensor": "rounding not measured: {optimizer}'s parameters are DTensors, whose "
        "comparison would be a collective",
        "rounding_not_measured_shared": "rounding not measured: {optimizer}'s parameters are in shared memory, "
        "where other processes may update them during the step (Hogwild)",
    }
    changed_figure = ("optimizers_fused", "{} optimizer(s) run as one fused kernel per step")
    targets = tuple(f"torch.optim.{cls.__name__}.__init__" for cls in FUSABLE)
    acts_on = (
        "torch.optim.{Adam,AdamW,SGD}.step, wrapped when the first such optimizer is built",
        "HPU: torch.optim.Optimizer.__getstate__, wrapped with it (copies and pickles in torch's format)",
    )

    def apply(self) -> None:
        self.figures.update(optimizers_fused=0, optimizers_kept=0)
        self._native = self.backend.name != "hpu"
        # CUDA/CPU: user's optimizer -> the state dict whose steps are in the fused kernel's format
        self._fused = weakref.WeakKeyDictionary()
        self._delegates = weakref.WeakKeyDictionary()  # HPU: user's optimizer -> (hpex optimizer, hook handles)
        self._mirrors = weakref.WeakKeyDictionary()  # HPU: user's optimizer -> {id(group): (group, mirror)}
        self._raw_steps = {}  # optimizer class -> its step inside torch's hook layer
        self._getstate_wrapped = False
        self._extra_settings = {}  # optimizer class -> hpex-only group settings (bias_correction, ...)
        self._hooked_step = torch.optim.Optimizer.profile_hook_step(self._checked_step)
        self._rounding_steps, self._largest_rounding = 0, 0.0  # fused steps measured against torch's own
        self._times = weakref.WeakKeyDictionary()  # optimizer -> its UpdateTimes, from its first fused step
        self._decided_in_step = False  # a timing decided (or given up) in the step now running
        if not self.backend.host_runs_ahead:
            self.on(Event.TRAINING_STEP, self._step_ended)
        for optimizer_class in FUSABLE:
            self.wrap(optimizer_class, "__init__", functools.partial(self._init, optimizer_class))
        self.on_revert(self._hand_state_back_to_torch)
        self.on_revert(self._fused.clear)
        self.because("torch_fused" if self._native else "hpex")

    def _init(self, owner, wrapped, instance, args, kwargs):
        if type(instance) is not owner or self.session.steps.in_own_work:  # a subclass, AdamW running
            return wrapped(*args, **kwargs)  # Adam's __init__, or an optimizer of autogaudi's own copy
        refusal, hyperparameters = self._refusal(owner, args, kwargs)
        result = wrapped(*args, **kwargs)  # exactly the script's call: nothing of ours on the object
        # The earliest the trained parameters are known (autogaudi.placement): off the device, the
        # hpex path steps aside here, before this optimizer gets a delegate.
        self.session.placement.observe(
            [p for group in instance.param_groups for p in group["params"]], "optimizer's construction"
        )
        if self.set_aside:
            return result
        if refusal:
            self._kept(owner, refusal)
            return result
        unfusable = self._unfusable(instance)
        if unfusable:
            self._kept(owner, unfusable.text, refusal=unfusable.code)
            self._count_refusal(unfusable)
        elif self._native:
            self._fused[instance] = None
            self._route_steps(owner)
            self.figures["optimizers_fused"] += 1
            self.because("torch_fused")
        else:
            self._attach_hpu_delegate(owner, instance, hyperparameters)
        return result

    def needs_work_on_device(self) -> bool:
        return not self._native  # the hpex path; torch's fused=True runs on the host too

    def _refusal(self, owner, args, kwargs):
        chosen = [f"{name}={kwargs[name]!r}" for name in ("fused", "foreach") if kwargs.get(name) is not None]
        if chosen:
            return f"the script chose {chosen[0]}", None
        try:
            hyperparameters = user_hyperparameters(owner, args, kwargs)
        except TypeError:  # the user's call is wrong: let torch raise its own error
            return "the constructor arguments do not bind", None
        return self.backend.fused_optimizer_refusal(owner, hyperparameters), hyperparameters

    def _unfusable(self, optimizer):
        """Why the fused kernel would refuse this optimizer's tensors at its step, as a Reason, or None.
        torch checks these only inside ``step()`` (after building the optimizer without complaint)."""
        if not self._native:
            refused_by = "an hpex fused optimizer"
        elif type(optimizer) not in TAKES_DTENSOR:
            refused_by = f"torch's fused {type(optimizer).__name__}"
        else:
            refused_by = None
        found = unfusable_tensor(optimizer, dtensor_refused_by=refused_by)
        return self.reason_for(found[0], **found[1]) if found else None

    def _kept(self, owner, why: str, code: str = "optimizer_kept", refusal=None) -> None:
        """A note that ``owner``'s optimizer runs unfused, ``why`` (the code of the kernel's refusal
        where there is one, as ``refusal``)."""
        self.figures["optimizers_kept"] += 1
        self.note(code, optimizer=owner.__name__, why=why, refusal=refusal)

    def _count_refusal(self, reason) -> None:
        refusals = self.figures.setdefault("kernel_refusals", {})
        refusals[reason.code] = refusals.get(reason.code, 0) + 1

    def _unfuse(self, optimizer, reason) -> None:
        """From this step on, ``optimizer`` runs as the script built it: torch's own unfused step."""
        if self._stop_fusing(optimizer):
            self._kept(type(optimizer), reason.text, "optimizer_unfused", refusal=reason.code)
            self._count_refusal(reason)

    def _stop_fusing(self, optimizer) -> bool:
        """Give ``optimizer`` back to torch's own step, its state in the unfused format; False where
        it was not fused."""
        if optimizer in self._fused:
            del self._fused[optimizer]
        elif not self._hand_back(optimizer):
            return False
        _unfused_format_steps(optimizer)
        self.figures["optimizers_fused"] -= 1
        self._decided_in_step = True  # it was perhaps still timed
        return True

    def numerics_in_run(self) -> tuple:
        # An optimizer put back ran fused in its timed steps: their rounding is in the run.
        return self.numerics_on(self.backend) if self.changes() or self.figures.get("optimizers_put_back") else ()

    def watching(self) -> bool:
        # With none fused: waiting for an optimizer, unless one was timed and put back (decided).
        return not self.figures.get("optimizers_put_back")

    def deciding(self) -> bool:
        # A fused optimizer still timed may yet be put back; its timed steps also make copies.
        return any(not times.decided for optimizer, times in self._times.items() if self._still_fused(optimizer))

    def measuring_steps(self) -> bool:
        # The timed steps run torch's unfused update too, on copies: a step timed by a trial meanwhile
        # (a remembered capture's check read w1's steps 1.73x slow) would count that.
        return self.deciding()

    # Each step of an optimizer it fused --------------------------------------------------------

    def _route_steps(self, owner) -> None:
        if owner not in self._raw_steps:
            # Wrapped only now that torch has put its hook layer on `owner.step` (it does so in the
            # first __init__), so this wrapper sits outside it and can route the step.
            self._raw_steps[owner] = owner.step.__wrapped__
            self.wrap(owner, "step", self._step)

    def _step(self, wrapped, instance, args, kwargs):
        if instance not in self._fused and instance not in self._delegates:
            return wrapped(*args, **kwargs)
        if len(args) + len(kwargs) > 1 or set(kwargs) - {"closure"}:  # torch raises its own TypeError
            return wrapped(*args, **kwargs)
        # Through torch's own hook layer, so the user's step hooks (and schedulers) see `instance`. The
        # routed step is the user's call as the guard sees it: it runs the closure and the step hooks,
        # whose exceptions are the user's (never a reason to run the step again).
        return wrapped.instead(functools.partial(self._hooked_step, instance))(*args, **kwargs)

    def _checked_step(self, optimizer, closure=None):
        """torch's step, with the closure run first (its gradients are checked too) and the update
        fused only where the kernel takes this step's tensors; else the script's own unfused step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # the user's code: its exceptions propagate untouched
        reference, times = None, None
        with self.fail_open():
            unfusable = self._unfusable(optimizer)
            if unfusable:
                self._unfuse(optimizer, unfusable)
            else:
                times = self._times_this_step(optimizer)
                reference = self._unfused_reference(optimizer, times)
        started = steps.clock() if times is not None and reference is not None else None
        if optimizer in self._fused:
            self._torch_fused_step(optimizer)
        elif optimizer in self._delegates:
            self._delegate_step(optimizer)
        else:
            self._raw_steps[type(optimizer)](optimizer)
        if reference is not None:
            ended = steps.clock() if started is not None else None
            with self.fail_open():
                self._rounding_measured(optimizer, reference)
                if started is not None and self._still_fused(optimizer):
                    times.fused.append(ended - started)
                    self._decide(optimizer, times)
        return loss

    def _still_fused(self, optimizer) -> bool:
        return optimizer in self._fused or optimizer in self._delegates

    # Is the fused update faster? -------------------------------------------------------------------

    def _times_this_step(self, optimizer):
        """The UpdateTimes this step's updates go to, or None: timed only where the host waits for
        each op (CPU; where it queues ahead of the device, timing would take a synchronisation, on HPU
        lazy a graph break, the run would not have), not with several ranks (each would decide on its
        own timings, and replicas on different kernels drift apart), not in an optimizer's first
        fused step (both updates allocate the state), and not once decided."""
        if self.backend.host_runs_ahead:
            return None
        if optimizer not in self._times:  # its first fused step: whether it will be timed is settled here
            self._times[optimizer] = UpdateTimes(decided=several_ranks())
            if self._times[optimizer].decided:
                self.note("not_timed_several_ranks")
            return None
        times = self._times[optimizer]
        return None if times.decided else times

    def _timed_unfused_step(self, optimizer, times) -> None:
        started = steps.clock()
        self._raw_steps[type(optimizer)](optimizer)
        times.unfused.append(steps.clock() - started)

    def _decide(self, optimizer, times) -> None:
        """With TIMED_STEPS updates timed each way, or SETTLED_AFTER where the two sets are apart: keep
        the fused one where the trials' rule finds it faster on the medians, else put the optimizer
        back to the script's own kernels."""
        self._update_figure()
        timed = len(times.fused)
        if timed < TIMED_STEPS and not (timed >= SETTLED_AFTER and times.apart()):
            return
        times.decided = True
        fused, unfused = statistics.median(times.fused), statistics.median(times.unfused)
        if not trials.faster(fused, unfused):
            self._put_back(optimizer, fused, unfused, len(times.fused))
        self._decided_in_step = True

    def _put_back(self, optimizer, fused: float, unfused: float, steps: int) -> None:
        """``optimizer`` back to the script's own kernels from its next step on, as measured slower."""
        if not self._stop_fusing(optimizer):
            return
        self.figures["optimizers_put_back"] = self.figures.get("optimizers_put_back", 0) + 1
        said = dict(
            optimizer=type(optimizer).__name__,
            fused=round(1000 * fused, 3),
            unfused=round(1000 * unfused, 3),
            steps=steps,
        )
        self.note("fused_slower", **said)
        if not self.figures["optimizers_fused"]:
            self.because("fused_slower", **said)

    def _step_ended(self, _optimizer) -> None:
        """A decision made in a step counts once the step is over: the run's steady state starts after it."""
        if self._decided_in_step:
            self._decided_in_step = False
            self.session.check_settled()

    def _update_figure(self) -> None:
        """``update_ms``: the updates timed of the optimizers still fused, fused against torch's
        unfused one on the same steps (the report's effect of the unit); where every optimizer timed
        was put back, what they measured stays."""
        timed = [times for optimizer, times in self._times.items() if self._still_fused(optimizer) and times.fused]
        if not timed:
            return
        fused = [seconds for times in timed for seconds in times.fused]
        unfused = [seconds for times in timed for seconds in times.unfused]
        self.figures["update_ms"] = {
            "unfused": round(1000 * statistics.median(unfused), 3),
            "fused": round(1000 * statistics.median(fused), 3),
            "steps": len(fused),
        }

    # How far the fused update is from torch's own -------------------------------------------------

    def _unfused_reference(self, optimizer, times):
        """In the run's first MEASURED_STEPS fused steps, and in the steps ``times`` (UpdateTimes or
        None) is timed in: the parameters torch's unfused step would give from this state, computed
        on copies (:func:`autogaudi.numerics.unfused_update`); else None. Where a copy would not fit,
        or the parameters are DTensors or shared with other processes (whose writes a comparison
        would count), it is neither measured nor timed."""
        if (self._rounding_steps >= MEASURED_STEPS and times is None) or not self._still_fused(optimizer):
            return None
        name = type(optimizer).__name__
        if not numerics.plain_tensors(optimizer):
            self._not_measured(optimizer, "rounding_not_measured_dtensor", optimizer=name)
            return None
        if any(param.is_shared() for param in numerics.parameters(optimizer)):
            self._not_measured(optimizer, "rounding_not_measured_shared", optimizer=name)
            return None
        tensors = numerics.optimizer_tensors(optimizer)
        if not numerics.copy_fits(tensors, self.backend):
            gb = sum(tensor.numel() * tensor.element_size() for tensor in tensors) / 1024**3
            self._not_measured(
                optimizer, "rounding_not_measured_memory", optimizer=name, gb=gb, share=numerics.FREE_SHARE
            )
            return None
        step = self._raw_steps[type(optimizer)]
        if times is not None:
            step = functools.partial(self._timed_unfused_step, times=times)
        return numerics.unfused_update(optimizer, step, self._group_steps(optimizer))

    def _not_measured(self, of, code: str, **params) -> None:
        """No copies: the rounding is not measured, and the fused update of ``of`` (an optimizer) stays untimed."""
        self._rounding_steps = MEASURED_STEPS
        self._times.setdefault(of, UpdateTimes()).decided = True
        self.note(code, **params)
        self._decided_in_step = True

    def _rounding_measured(self, optimizer, reference) -> None:
        """The fused step just taken against ``reference``, while the optimizer is still fused (a
        fused step that raised finished unfused: nothing to compare)."""
        if self._rounding_steps >= MEASURED_STEPS or not self._still_fused(optimizer):
            return
        difference = numerics.largest_relative_difference(numerics.parameters(optimizer), reference)
        self._rounding_steps += 1
        self._largest_rounding = max(self._largest_rounding, difference)
        self.figures["numerics_measured"] = numerics.measured(
            self._largest_rounding, of="parameters", steps=self._rounding_steps, against="torch's unfused step"
        )

    # CUDA / CPU: torch's own fused kernels -------------------------------------------------------

    def _torch_fused_step(self, optimizer) -> None:
        """torch's step with ``fused=True`` set in each group for the time of its update, one group at
        a time: a group the kernel refuses (torch checks a group's tensors before updating any) is
        run unfused with the groups after it, the groups before it being done. Outside the step the
        groups hold the script's value, so state_dict(), copies and pickles are the script's."""
        if self._fused[optimizer] is not optimizer.state:  # new, or replaced by load_state_dict()
            _fused_format_steps(optimizer)
            self._fused[optimizer] = optimizer.state
        step = self._raw_steps[type(optimizer)]
        groups = optimizer.param_groups
        try:
            for index, group in enumerate(groups):
                optimizer.param_groups = [group]
                counters = _step_counters(optimizer, group)
                try:
                    with _fused_flag(group):
                        step(optimizer)
                except Exception as error:
                    _rewind(optimizer, group, counters)
                    optimizer.param_groups = groups  # every group's counters to the unfused format
                    self._unfuse(optimizer, self.reason_for("fused_step_raised", error=error))
                    optimizer.param_groups = groups[index:]
                    step(optimizer)  # plain PyTorch's step for the rest: its errors are its own
                    return
        finally:
            optimizer.param_groups = groups

    # HPU: an hpex optimizer behind the user's torch.optim object --------------------------------

    def _attach_hpu_delegate(self, owner, instance, hyperparameters) -> None:
        params = [p for group in instance.param_groups for p in group["params"]]
        if not params:
            self._kept(owner, "it has no parameters yet")
            return
        delegate = self.backend.fused_optimizer(owner, params, hyperparameters)
        # Share the user's state and mirror their groups before each step: schedulers,
        # param_groups edits and checkpoints act on the user's object, the kernel sees the result.
        self._extra_settings[owner] = {
            key: value for key, value in delegate.defaults.items() if key not in instance.defaults
        }
        self._share_groups(instance, delegate)
        handles = (
            self.hook(
                instance.register_state_dict_post_hook,
                functools.partial(_torch_format_checkpoint, steps=self._group_steps),
            ),
            self.hook(instance.register_load_state_dict_post_hook, _int_steps),
        )
        _int_steps(instance)
        self._delegates[instance] = (delegate, handles)
        self._route_steps(owner)
        if not self._getstate_wrapped:
            # A copy or pickle of the object carries torch's state (tensor steps from the group
            # counters), which a plain torch.optim object steps on correctly.
            self._getstate_wrapped = True
            self.wrap(torch.optim.Optimizer, "__getstate__", self._torch_format_getstate)
        self.figures["optimizers_fused"] += 1

    def _share_groups(self, instance, delegate) -> None:
        """Point the hpex optimizer at the user's state (``load_state_dict`` replaces that dict) and
        at one mirror per non-empty user group (it rejects empty ones): the user's current values
        (a scheduler's lr) plus its own settings and counters, kept across steps. A new group (or
        one ``load_state_dict`` rebuilt) starts its counter from its parameters' saved steps."""
        delegate.state = instance.state
        extra = self._extra_settings[type(instance)]
        known = self._mirrors.setdefault(instance, {})
        mirrors = {}
        for group in instance.param_groups:
            if not group["params"]:
                continue
            kept, mirror = known.get(id(group), (None, None))
            if kept is not group:  # a new group, or one whose id was reused
                mirror = {**extra, **_saved_step(group, instance.state)}
            mirror.update(group)
            mirrors[id(group)] = (group, mirror)
        self._mirrors[instance] = mirrors
        delegate.param_groups = [mirror for _, mirror in mirrors.values()]

    def _group_steps(self, optimizer) -> dict:
        """The step count of each parameter, from its group's counter (the bridge keeps no other)."""
        return {
            id(param): mirror["step"]
            for _, mirror in self._mirrors.get(optimizer, {}).values()
            if "step" in mirror
            for param in mirror["params"]
        }

    def _delegate_step(self, optimizer) -> None:
        done = False
        with self.fail_open():
            delegate = self._delegates[optimizer][0]
            self._share_groups(optimizer, delegate)  # add_param_group / load_state_dict may have run
            _raw_step(delegate)(delegate)
            done = True
        if not done:  # the unit was reverted and the state handed back: take torch's own step
            self._raw_steps[type(optimizer)](optimizer)

    def _torch_format_getstate(self, wrapped, instance, args, kwargs):
        state = wrapped(*args, **kwargs)
        if instance not in self._delegates:
            return state
        steps = self._group_steps(instance)
        per_param = {
            param: {**values, "step": _torch_step(steps.get(id(param), values["step"]))} if "step" in values else values
            for param, values in state["state"].items()
        }
        return {**state, "state": collections.defaultdict(dict, per_param)}

    def _hand_back(self, optimizer) -> bool:
        """Give an hpex-stepped optimizer back to torch: its state in torch's format, no hook of ours
        left on it. False where it was not one."""
        delegate = self._delegates.pop(optimizer, None)
        if delegate is None:
            return False
        steps = self._group_steps(optimizer)
        for param, state in optimizer.state.items():
            if "step" in state:
                state["step"] = _torch_step(steps.get(id(param), state["step"]))
        for handle in delegate[1]:
            handle.remove()
        self._mirrors.pop(optimizer, None)
        return True

    def _hand_state_back_to_torch(self) -> None:
        for optimizer in list(self._delegates):
            self._hand_back(optimizer)


def _int_steps(optimizer) -> None:
    """The hpex optimizers keep ``step`` as a Python int (torch: a float32 tensor)."""
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = int(state["step"].item())


def _torch_step(step):
    """torch keeps ``step`` as a float32 tensor; the hpex optimizers keep a Python int."""
    return torch.tensor(float(step)) if isinstance(step, int) else step


def _saved_step(group, state) -> dict:
    """``{"step": n}`` for a group whose parameters carry a saved step (a loaded checkpoint), else {}."""
    saved = [int(state[param]["step"]) for param in group["params"] if "step" in state.get(param, {})]
    return {"step": max(saved)} if saved and max(saved) > 0 else {}


def _torch_format_checkpoint(optimizer, state_dict, steps):
    """Torch's checkpoint format: each parameter's ``step`` a tensor, counted by its group. Copies:
    the per-parameter dicts in ``state_dict()`` are the live state the fused kernel uses."""
    indexed = {
        index: param
        for group, saved in zip(optimizer.param_groups, state_dict["param_groups"])
        for index, param in zip(saved["params"], group["params"])
    }
    group_steps = steps(optimizer)
    state = {
        index: {**values, "step": _torch_step(group_steps.get(id(indexed.get(index)), values["step"]))}
        if "step" in values
        else values
        for index, values in state_dict["state"].items()
    }
    return {**state_dict, "state": state}
