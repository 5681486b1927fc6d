"""Adam, AdamW and SGD as one fused kernel per step instead of a loop of small ops per parameter.

Why: the stock optimizers launch several ops per parameter every step; the Gaudi guide (hpex
``FusedAdamW``/``FusedSGD``) and the Hugging Face guide (``fused=True``) both fuse them. The
script's optimizer is built as written and stays the script's, so its checkpoints, copies and
pickles are plain PyTorch's: on CPU and CUDA each step sets ``fused=True`` for the time of the
update; on HPU the step runs an hpex optimizer that shares its state (:mod:`.hpu_format`).

A fused update rounds otherwise than torch's per-op one. Where the host waits for each op (CPU), it
is worth fusing only if timed faster, and a timing moves with the machine's load: under the defaults
the optimizer is left as built (``changes_numbers``), so a seeded run's numbers never hang on a clock.
Asked for (``--trial fused_optimizer``), the run keeps torch's unfused step while the fused update is
timed beside it on copies, and switches after a fixed number of steps, only for a gain worth its
rounding (:mod:`.update_times`). Where the host queues ahead of the device (CUDA, HPU) the fused
update runs from the first step, untimed, in every run, its first steps measured against torch's
unfused step on copies. What torch refuses only inside the fused step is
checked before each update (:mod:`.kernels`). docs/units/fused_optimizer.md has the rules and the measurements.
"""

from __future__ import annotations

import collections
import functools
import weakref

import torch
import wrapt

from autogaudi.core.candidate import untried_reason
from autogaudi.core.events import Event
from autogaudi.core.unit import FORMULA, ROUNDING, Unit, UnitSpec
from autogaudi.entry.ranks import several_ranks
from autogaudi.measure import machine_load, numerics, trials
from autogaudi.optimizations.fused_optimizer.hpu_delegate import HpuDelegates
from autogaudi.optimizations.fused_optimizer.kernels import (
    fused_format_steps,
    step_group_by_group,
    unfusable_tensor,
    unfused_format_steps,
    user_hyperparameters,
)
from autogaudi.optimizations.fused_optimizer.reasons import REASONS
from autogaudi.store.decisions import origin
from autogaudi.watch import steps

update_times = wrapt.lazy_import("autogaudi.optimizations.fused_optimizer.update_times")  # where an update is timed

FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
# The classes whose torch kernel DTensor (FSDP2's parameters) has a sharding rule for (_fused_adam_,
# _fused_adamw_); torch 2.13 has none for _fused_sgd_: SGD over DTensors raises NotImplementedError.
TAKES_DTENSOR = (torch.optim.Adam, torch.optim.AdamW)
# The run's first steps, the fused update set beside torch's unfused one from the same state (one of
# them on copies): how far one fused update rounds from torch's own, for the report (numerics_measured).
MEASURED_STEPS = 3
# The updates timed per optimizer, fused against unfused, after its first step (which allocates the
# state both ways): as many as a trial's arm. The decision is taken after exactly these, in every run.
TIMED_STEPS = 2 * trials.BLOCK * trials.ROUNDS


def in_shared_memory(optimizer) -> bool:
    """Whether ``optimizer``'s parameters are in shared memory (Hogwild: other processes write them
    during a step, so no copy of them compares)."""
    return any(param.is_shared() for param in numerics.parameters(optimizer))


class FusedOptimizer(HpuDelegates, Unit):
    spec = UnitSpec(
        numerics=(ROUNDING,),  # one fused update rounds otherwise than torch's per-op one (measured on CPU)
        reasons=REASONS,
        changed_figure=("optimizers_fused", "{} optimizer(s) run as one fused kernel per step"),
        targets=tuple(f"torch.optim.{cls.__name__}.__init__" for cls in FUSABLE),
        acts_on=(
            "torch.optim.{Adam,AdamW,SGD}.step, wrapped when the first such optimizer is built",
            "HPU: torch.optim.Optimizer.__getstate__, wrapped with it (copies and pickles in torch's format)",
        ),
    )

    @classmethod
    def numerics_on(cls, backend) -> tuple:
        """On HPU the hpex kernels: FusedAdamW adds eps before the bias correction (:mod:`.hpu_format`)."""
        return (ROUNDING, FORMULA) if backend.name == "hpu" else cls.spec.numerics

    def apply(self) -> None:
        self.report.figures.update(optimizers_fused=0, optimizers_kept=0)
        self._fused_count = 0  # optimizers fused now
        self._put_back_count = 0  # optimizers timed and kept unfused (their steps never ran fused)
        self._step_seconds = collections.deque(maxlen=TIMED_STEPS)  # the training steps while timing
        self._last_step_end = None
        self._native = self.run.backend.name != "hpu"
        # CUDA/CPU: user's optimizer -> the state dict whose steps are in the fused kernel's format
        self._fused = weakref.WeakKeyDictionary()
        self._delegates = weakref.WeakKeyDictionary()  # HPU: user's optimizer -> (hpex optimizer, hook handles)
        self._mirrors = weakref.WeakKeyDictionary()  # HPU: user's optimizer -> {id(group): (group, mirror)}
        self._raw_steps = {}  # optimizer class -> its step inside torch's hook layer
        self._getstate_wrapped = False
        self._extra_settings = {}  # optimizer class -> hpex-only group settings (bias_correction, ...)
        self._hooked_step = torch.optim.Optimizer.profile_hook_step(self._checked_step)
        self._rounding_steps, self._largest_rounding = 0, 0.0  # fused steps measured against torch's own
        # CPU: optimizer -> its UpdateTimes while the fused update is measured beside its own unfused step
        self._trying = weakref.WeakKeyDictionary()
        self._timed = []  # the UpdateTimes of every optimizer timed (the report's update_ms)
        self._steps_seen = weakref.WeakKeyDictionary()  # optimizer being decided -> its steps counted at the last step
        self._record = None  # the last decision timed, for a later run to follow (measured_decision)
        if not self.run.backend.host_runs_ahead:
            self.scope.on(Event.TRAINING_STEP, self._step_ended)
        for optimizer_class in FUSABLE:
            self.scope.wrap(optimizer_class, "__init__", functools.partial(self._init, optimizer_class))
        self.scope.add(self._hand_state_back_to_torch)
        self.scope.add(self._fused.clear)
        self.report.because("torch_fused" if self._native else "hpex")

    def _init(self, owner, wrapped, instance, args, kwargs):
        if type(instance) is not owner or self.run.steps.in_own_work:  # a subclass, AdamW running
            return wrapped(*args, **kwargs)  # Adam's __init__, or an optimizer of autogaudi's own copy
        refusal, hyperparameters = self._refusal(owner, args, kwargs)
        result = wrapped(*args, **kwargs)  # exactly the script's call: nothing of ours on the object
        # The earliest the trained parameters are known (autogaudi.watch.placement): off the device, the
        # hpex path steps aside here, before this optimizer gets a delegate.
        self.run.placement.observe(
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
        elif self._native and self._timed_here(instance):
            untried = untried_reason(self)  # its timing would choose the run's numbers: only where asked for
            if untried is not None:
                self.report.figures["optimizers_kept"] += 1
                self.report.reason = untried
                return result
            times = self._trying[instance] = update_times.UpdateTimes(optimizer=instance)
            self._timed.append(times)
            self.run.trials.measuring(self, times)
            self._route_steps(owner)
            self.report.because("timing")
        elif self._native:
            self._fuse(instance)
            self._route_steps(owner)
        else:
            self._attach_hpu_delegate(owner, instance, hyperparameters)
        return result

    def _timed_here(self, optimizer) -> bool:
        """Whether this optimizer's update is timed before it is fused: only where the host waits for
        each op (CPU; where it queues ahead of the device, timing would take a synchronisation, on HPU
        lazy a graph break, the run would not have), and not with several ranks (each would decide on
        its own timings, and replicas on different kernels drift apart), nor over parameters in shared
        memory (Hogwild: other processes update them during a step, so no copy compares; the run's
        numbers race anyway). ``--force``d: fused untimed, the user taking its rounding."""
        if self.run.backend.host_runs_ahead or self.name in self.run.options.force:
            return False
        if in_shared_memory(optimizer):
            return False
        if several_ranks():
            self.report.note("not_timed_several_ranks")
            return False
        return True

    def _fuse(self, optimizer) -> None:
        """From its next update on, ``optimizer`` runs torch's fused kernel (CPU, CUDA)."""
        self._fused[optimizer] = None
        self._count_fused(+1)
        self.report.because("torch_fused")

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
        return self.run.backend.fused_optimizer_refusal(owner, hyperparameters), hyperparameters

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
        return self.report.reason_for(found[0], **found[1]) if found else None

    def _kept(self, owner, why: str, code: str = "optimizer_kept", refusal=None) -> None:
        """A note that ``owner``'s optimizer runs unfused, ``why`` (the code of the kernel's refusal
        where there is one, as ``refusal``)."""
        self.report.figures["optimizers_kept"] += 1
        self.report.note(code, optimizer=owner.__name__, why=why, refusal=refusal)

    def _count_refusal(self, reason) -> None:
        refusals = self.report.figures.setdefault("kernel_refusals", {})
        refusals[reason.code] = refusals.get(reason.code, 0) + 1

    def _unfuse(self, optimizer, reason) -> None:
        """From this step on, ``optimizer`` runs as the script built it: torch's own unfused step."""
        if self._stop_fusing(optimizer):
            self._kept(type(optimizer), reason.text, "optimizer_unfused", refusal=reason.code)
            self._count_refusal(reason)

    def _stop_fusing(self, optimizer) -> bool:
        """Give ``optimizer`` back to torch's own step, its state in the unfused format; False where
        it was not fused (or timed: it then never ran fused)."""
        times = self._trying.pop(optimizer, None)
        if times is not None:
            times.stop(decided=False)
            self._release_windows()
            return True
        if optimizer in self._fused:
            del self._fused[optimizer]
        elif not self._hand_back(optimizer):
            return False
        unfused_format_steps(optimizer)
        self._count_fused(-1)
        return True

    def _count_fused(self, change: int) -> None:
        self._fused_count += change
        self.report.figures["optimizers_fused"] = self._fused_count

    def numerics_in_run(self) -> tuple:
        # An optimizer timed and kept unfused never ran fused: only a fused one's rounding is in the run.
        return self.numerics_on(self.run.backend) if self._fused_count else ()

    # Each step of an optimizer it fused --------------------------------------------------------

    def _route_steps(self, owner) -> None:
        if owner not in self._raw_steps:
            # Wrapped only now that torch has put its hook layer on `owner.step` (it does so in the
            # first __init__), so this wrapper sits outside it and can route the step.
            self._raw_steps[owner] = owner.step.__wrapped__
            self.scope.wrap(owner, "step", self._step)

    def _step(self, wrapped, instance, args, kwargs):
        if instance not in self._fused and instance not in self._delegates and instance not in self._trying:
            return wrapped(*args, **kwargs)
        if len(args) + len(kwargs) > 1 or set(kwargs) - {"closure"}:  # torch raises its own TypeError
            return wrapped(*args, **kwargs)
        # Through torch's own hook layer, so the user's step hooks (and schedulers) see `instance`. The
        # routed step is the user's call as the guard sees it: it runs the closure and the step hooks,
        # whose exceptions are the user's (never a reason to run the step again).
        return wrapped.instead(functools.partial(self._hooked_step, instance))(*args, **kwargs)

    def _checked_step(self, optimizer, closure=None):
        """torch's step, with the closure run first (its gradients are checked too) and the update
        fused only where the kernel takes this step's tensors; else the script's own unfused step.
        While an optimizer is timed, its step is torch's unfused one and the fused update runs beside
        it on copies."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # the user's code: its exceptions propagate untouched
        reference, shadow = None, None
        with self.fail_open():
            unfusable = self._unfusable(optimizer)
            if unfusable:
                self._unfuse(optimizer, unfusable)
            elif optimizer in self._trying and self.run.recalled_trial(self.name) is None:
                shadow = self._fused_on_copies(optimizer)
            else:
                reference = self._unfused_reference(optimizer)
        started = steps.clock()
        if optimizer in self._fused:
            self._torch_fused_step(optimizer)
        elif optimizer in self._delegates:
            self._delegate_step(optimizer)
        else:
            self._raw_steps[type(optimizer)](optimizer)
        unfused_s = steps.clock() - started
        with self.fail_open():
            if reference is not None and self._still_fused(optimizer):
                self._rounding_measured(numerics.parameters(optimizer), reference)
            elif optimizer in self._trying:
                if shadow is not None:
                    self._rounding_measured(shadow[0], numerics.parameters(optimizer))
                self._counted_step(optimizer, shadow[1] if shadow is not None else None, unfused_s)
        return loss

    def _still_fused(self, optimizer) -> bool:
        return optimizer in self._fused or optimizer in self._delegates

    # Is the fused update faster? -------------------------------------------------------------------

    def _fused_on_copies(self, optimizer):
        """(the parameters the fused update gives from this state, its seconds) on copies, the
        optimizer and its tensors left as they were; None where no copy is made (it is then fused
        untimed from this step on: see :meth:`_copies_refused`)."""
        if self._copies_refused(optimizer):
            return None
        seconds = []

        def fused_update(copy) -> None:  # ``copy``: the optimizer holding the copied groups and state
            for group in copy.param_groups:
                group["fused"] = True  # the copied group only: the script's stays as it set it
            started = steps.clock()
            self._raw_steps[type(optimizer)](copy)
            seconds.append(steps.clock() - started)

        try:  # numerics.unfused_update runs the step it is given on copies: here the fused one
            return numerics.unfused_update(optimizer, fused_update), seconds[0]
        except RuntimeError as error:  # the kernel refused these tensors: the run never needed it
            self._unfuse(optimizer, self.report.reason_for("fused_step_raised", error=error))
            return None

    def _counted_step(self, optimizer, fused_s, unfused_s: float) -> None:
        """One more step of an optimizer being decided: after its first (which allocates the state
        both ways), both updates' times go to its UpdateTimes (``fused_s`` None: not timed, a
        remembered decision is followed); after 1 + TIMED_STEPS steps it is decided, in this step,
        whatever the timings: the step it switches at is the same in every run, first or warm."""
        times = self._trying[optimizer]
        times.steps += 1
        self.run.windows.take(self)  # timed: no other measurement starts meanwhile (none is waited for)
        if fused_s is not None and times.steps > 1:
            times.fused.append(fused_s)
            times.unfused.append(unfused_s)
            self._update_figure()
        if times.steps > TIMED_STEPS:
            self._decide(optimizer, times)

    def _release_windows(self) -> None:
        """The steps are given back once no optimizer that has stepped is still timed: one built and
        never stepped holds no other measurement back."""
        if not any(times.steps for times in self._trying.values()):
            self.run.windows.release(self)

    def _decide(self, optimizer, times) -> None:
        """Fuse the optimizer from its next step where the trials' rule finds the fused update faster
        by a gain material to the step, else keep it on the script's own kernels, never fused; where
        a run with the same set-up, model and inputs decided, as it did."""
        del self._trying[optimizer]
        times.stop(decided=True)
        self._release_windows()
        remembered = self.run.recalled_trial(self.name)
        if remembered is not None:
            self._follow(optimizer, remembered)
            return
        fused, unfused = trials.median(times.fused), trials.median(times.unfused)
        self._record = {
            "candidate": self.name,
            "decision": "rejected",
            "speedup": round(unfused / fused, 3) if fused else None,
            "ms_per_step_with": round(1000 * fused, 3),
            "ms_per_step_without": round(1000 * unfused, 3),
            "load": machine_load.slowdown(),
        }
        why = update_times.why_not_fused(times, self._step_s())
        if why is not None:
            self._put_back(optimizer, why[0], steps=len(times.fused), **why[1])
        else:
            self._record["decision"] = "kept"
            self._fuse(optimizer)

    def _follow(self, optimizer, record: dict) -> None:
        """A remembered decision, taken at the step the run that measured it took it."""
        said = dict(decision=record["decision"], speedup=record.get("speedup"), **origin(record))
        if record["decision"] == "kept":
            self._fuse(optimizer)
            self.report.because("remembered_timing", **said)
        else:
            self._put_back(optimizer, "remembered_timing", **said)

    def measured_decision(self):
        return self._record

    def _step_s(self):
        """The median training step measured while the updates were timed, or None."""
        return trials.median(self._step_seconds) if self._step_seconds else None

    def _put_back(self, optimizer, code: str, **values) -> None:
        """``optimizer`` kept on the script's own kernels, for ``code``: measured slower, or a gain
        too small to be worth its rounding."""
        self._put_back_count += 1
        self.report.figures["optimizers_put_back"] = self._put_back_count
        said = dict(optimizer=type(optimizer).__name__, **values)
        self.report.note(code, **said)
        if not self._fused_count:
            self.report.because(code, **said)

    def _step_ended(self, optimizer) -> None:
        """A decision made in a step counts once the step is over: the run's steady state starts after
        it. While an update is timed, the step's own time is kept: the gain is weighed against it. An
        optimizer being decided whose step did not come through the unit's route (an LR scheduler
        built after it wraps its step around the class's) is left as the script built it. A loop that
        updates its parameters by hand paces its steps on backward passes: no optimizer then."""
        times = self._trying.get(optimizer) if optimizer is not None else None
        if times is not None and times.steps == self._steps_seen.get(optimizer, 0):
            self._stop_fusing(optimizer)
            self._kept(type(optimizer), "its step does not reach the unit")
        elif times is not None:
            self._steps_seen[optimizer] = times.steps
        now = steps.clock()
        if self._last_step_end is not None and self._trying:
            self._step_seconds.append(now - self._last_step_end)
        self._last_step_end = now

    def _update_figure(self) -> None:
        """``update_ms``: every optimizer's updates timed, fused (on copies) against torch's unfused
        one on the same steps (the report's effect of the unit where one is fused)."""
        timed = [times for times in self._timed if times.fused]
        if timed:
            self.report.figures["update_ms"] = update_times.update_ms(timed)

    # How far the fused update is from torch's own -------------------------------------------------

    def _unfused_reference(self, optimizer):
        """In the run's first MEASURED_STEPS fused steps: the parameters torch's unfused step would
        give from this state, computed on copies (:func:`autogaudi.measure.numerics.unfused_update`); else None."""
        if self._rounding_steps >= MEASURED_STEPS or not self._still_fused(optimizer):
            return None
        if self._copies_refused(optimizer):
            return None
        return numerics.unfused_update(optimizer, self._raw_steps[type(optimizer)], self._group_steps(optimizer))

    def _copies_refused(self, optimizer) -> bool:
        """Whether no copy of ``optimizer``'s tensors is made: where a copy would not fit, or the
        parameters are DTensors or shared with other processes (whose writes a comparison would
        count). Its rounding is then not measured, and a timed optimizer is fused untimed from this
        step on, as where its update is not timed."""
        name = type(optimizer).__name__
        if not numerics.plain_tensors(optimizer):
            self._not_measured(optimizer, "rounding_not_measured_dtensor", optimizer=name)
        elif in_shared_memory(optimizer):
            self._not_measured(optimizer, "rounding_not_measured_shared", optimizer=name)
        elif not numerics.copy_fits(tensors := numerics.optimizer_tensors(optimizer), self.run.backend):
            gb = sum(tensor.numel() * tensor.element_size() for tensor in tensors) / 1024**3
            self._not_measured(
                optimizer, "rounding_not_measured_memory", optimizer=name, gb=gb, share=numerics.FREE_SHARE
            )
        else:
            return False
        return True

    def _not_measured(self, of, code: str, **params) -> None:
        """No copies: the rounding is not measured, and ``of`` (an optimizer), where it was to be
        timed, is fused untimed."""
        self._rounding_steps = MEASURED_STEPS
        self.report.note(code, **params)
        if self._trying.pop(of, None) is not None:
            self._fuse(of)
            self._release_windows()

    def _rounding_measured(self, fused, unfused) -> None:
        """One step's fused update (``fused``: its parameters) against torch's unfused one, in the
        run's first MEASURED_STEPS measured steps."""
        if self._rounding_steps >= MEASURED_STEPS:
            return
        difference = numerics.largest_relative_difference(fused, unfused)
        self._rounding_steps += 1
        self._largest_rounding = max(self._largest_rounding, difference)
        self.report.figures["numerics_measured"] = numerics.measured(
            self._largest_rounding, of="parameters", steps=self._rounding_steps, against="torch's unfused step"
        )

    # CUDA / CPU: torch's own fused kernels -------------------------------------------------------

    def _torch_fused_step(self, optimizer) -> None:
        """torch's step with ``fused=True`` set in each group for the time of its update, one group at
        a time: a group the kernel refuses (torch checks a group's tensors before updating any) is
        run unfused with the groups after it, the groups before it being done. Outside the step the
        groups hold the script's value, so state_dict(), copies and pickles are the script's."""
        if self._fused[optimizer] is not optimizer.state:  # new, or replaced by load_state_dict()
            fused_format_steps(optimizer)
            self._fused[optimizer] = optimizer.state
        step_group_by_group(
            optimizer,
            self._raw_steps[type(optimizer)],
            lambda error: self._unfuse(optimizer, self.report.reason_for("fused_step_raised", error=error)),
        )
