"""Adam, AdamW and SGD as one fused kernel per step instead of a loop of small ops per parameter.

Why: the stock optimizers launch several ops per parameter tensor every step; a fused kernel does
the whole update in one pass, which is what the Gaudi guide (hpex ``FusedAdamW``/``FusedSGD``) and
the Hugging Face guide (``fused=True``) recommend.

How, per backend:
- CUDA and CPU: the user's optimizer is built exactly as written plus ``fused=True`` (torch's own
  kernel). If torch refuses it for these parameters (device, dtype), it is built without.
- HPU: the user's ``torch.optim`` object is built as written and keeps every user-visible aspect
  (type, ``param_groups``, ``state``, schedulers, ``add_param_group``); its ``step`` runs an hpex
  fused optimizer that shares that state and mirrors each of the user's groups in a group of its
  own (its extra settings added, empty groups left out), with every hyperparameter passed
  explicitly (FusedAdamW's own defaults, eps 1e-6 and weight_decay 0.0, differ from torch's). The
  mirrors persist from step to step: the bridge's FusedAdamW counts steps in its group
  (``group["step"]``), and a mirror rebuilt each step made every step its first (a constant
  learning rate of sqrt(1-beta2)/(1-beta1) times the user's). The user's step hooks fire once.

Checkpoints stay plain PyTorch both ways: ``state_dict()`` reports the user's own ``fused`` value
and torch's per-parameter tensor ``step``, taken from the group counter; ``load_state_dict()``
accepts a plain checkpoint and the group counters continue from its steps.
Skipped per optimizer (with the reason) when the script chose ``fused``/``foreach`` itself, for
subclasses (their ``step`` may be their own), and for arguments the fused kernel lacks
(amsgrad, maximize, differentiable, … on HPU). Optimizers built while enabled stay fused after
``disable()``; it affects optimizers built afterwards.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch

from autogaudi.unit import Unit

FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def user_hyperparameters(optimizer_class, args, kwargs) -> dict:
    """Every hyperparameter the user's constructor call means, defaults included."""
    bound = inspect.signature(optimizer_class.__init__).bind(None, *args, **kwargs)
    bound.apply_defaults()
    values = dict(bound.arguments)
    for name in ("self", "params"):
        values.pop(name, None)
    return values


def _raw_step(optimizer):
    """The optimizer class's ``step`` without torch's hook layer (``profile_hook_step``)."""
    step = type(optimizer).step
    return getattr(step, "__wrapped__", step)


class FusedOptimizer(Unit):
    reasons = {"torch_fused": "torch fused=True kernels", "hpex": "hpex fused optimizers"}
    changed_figure = ("optimizers_fused", "{} optimizer(s) run as one fused kernel per step")
    targets = tuple(f"torch.optim.{cls.__name__}.__init__" for cls in FUSABLE)
    acts_on = ("HPU: torch.optim.{Adam,AdamW,SGD}.step, wrapped when the first such optimizer is built",)

    def apply(self) -> None:
        self.figures.update(optimizers_fused=0, optimizers_kept=0)
        self._native = self.backend.name != "hpu"
        self._delegates = weakref.WeakKeyDictionary()  # HPU: user's optimizer -> hpex optimizer
        self._mirrors = weakref.WeakKeyDictionary()  # HPU: user's optimizer -> {id(group): (group, mirror)}
        self._steps_wrapped = set()
        self._extra_settings = {}  # optimizer class -> hpex-only group settings (bias_correction, ...)
        self._hooked_delegate_step = torch.optim.Optimizer.profile_hook_step(self._delegate_step)
        for optimizer_class in FUSABLE:
            self.wrap(optimizer_class, "__init__", functools.partial(self._init, optimizer_class))
        self.on_revert(self._hand_state_back_to_torch)
        self.because("torch_fused" if self._native else "hpex")

    def _init(self, owner, wrapped, instance, args, kwargs):
        if type(instance) is not owner:  # a subclass, or AdamW running Adam's __init__
            return wrapped(*args, **kwargs)
        refusal, hyperparameters = "autogaudi could not read the arguments", None
        with self.fail_open():
            refusal, hyperparameters = self._refusal(owner, args, kwargs)
        if refusal:
            self._kept(owner, refusal)
            return wrapped(*args, **kwargs)
        if self._native:
            return self._init_with_torch_fused(owner, wrapped, instance, args, kwargs)
        result = wrapped(*args, **kwargs)
        with self.fail_open():
            self._attach_hpu_delegate(owner, instance, hyperparameters)
        return result

    def _refusal(self, owner, args, kwargs):
        chosen = [f"{name}={kwargs[name]!r}" for name in ("fused", "foreach") if kwargs.get(name) is not None]
        if chosen:
            return f"the script chose {chosen[0]}", None
        try:
            hyperparameters = user_hyperparameters(owner, args, kwargs)
        except TypeError:  # the user's call is wrong: let torch raise its own error
            return "the constructor arguments do not bind", None
        return self.backend.fused_optimizer_refusal(owner, hyperparameters), hyperparameters

    def _kept(self, owner, reason: str) -> None:
        self.figures["optimizers_kept"] += 1
        self.note(f"{owner.__name__} kept as is: {reason}")

    # CUDA / CPU: torch's own fused kernels -------------------------------------------------------

    def _init_with_torch_fused(self, owner, wrapped, instance, args, kwargs):
        try:
            result = wrapped(*args, **{**kwargs, "fused": True})
        except Exception as error:  # torch checks fused=True against the params (device, dtype)
            self._kept(owner, f"torch refused fused=True ({error})")
            return wrapped(*args, **kwargs)
        user_value = kwargs.get("fused")
        instance.register_state_dict_post_hook(functools.partial(_with_fused, value=user_value))
        instance.register_load_state_dict_pre_hook(functools.partial(_with_fused, value=True))
        self.figures["optimizers_fused"] += 1
        return result

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
        instance.register_state_dict_post_hook(functools.partial(_torch_format_checkpoint, steps=self._group_steps))
        instance.register_load_state_dict_post_hook(self._fused_format_state)
        self._fused_format_state(instance)
        self._delegates[instance] = delegate
        if owner not in self._steps_wrapped:
            # Wrapped only now that torch has put its hook layer on `owner.step` (it does so in the
            # first __init__), so this wrapper sits outside it and can route the step.
            self.wrap(owner, "step", self._step)
            self._steps_wrapped.add(owner)
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

    def _step(self, wrapped, instance, args, kwargs):
        if instance not in self._delegates:
            return wrapped(*args, **kwargs)
        # Through torch's own hook layer, so the user's step hooks (and schedulers) see `instance`.
        return self._hooked_delegate_step(instance, *args, **kwargs)

    def _delegate_step(self, optimizer, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # the user's code: its exceptions propagate untouched
        done = False
        with self.fail_open():
            delegate = self._delegates[optimizer]
            self._share_groups(optimizer, delegate)  # add_param_group / load_state_dict may have run
            _raw_step(delegate)(delegate)
            done = True
        if not done:  # the unit was reverted and the state handed back: take torch's own step
            _raw_step(optimizer)(optimizer)
        return loss

    @staticmethod
    def _fused_format_state(optimizer) -> None:
        for state in optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = int(state["step"].item())

    def _hand_state_back_to_torch(self) -> None:
        for optimizer in list(self._delegates):
            steps = self._group_steps(optimizer)
            for param, state in optimizer.state.items():
                if "step" in state:
                    state["step"] = _torch_step(steps.get(id(param), state["step"]))
        self._delegates.clear()
        self._mirrors.clear()


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


def _with_fused(optimizer, state_dict, value):
    """A copy of ``state_dict`` whose param groups say ``fused=value``."""
    groups = [{**group, "fused": value} for group in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}
