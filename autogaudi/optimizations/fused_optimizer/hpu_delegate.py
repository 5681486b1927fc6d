"""The fused optimizer on HPU: an hpex optimizer behind the user's ``torch.optim`` object, sharing its
state and mirroring its groups, so the script's object (its type, groups, state, schedulers and
checkpoints) stays plain PyTorch's while the update runs hpex's fused kernel (:mod:`.hpu_format`)."""

from __future__ import annotations

import functools

import torch
import wrapt

hpu_format = wrapt.lazy_import("autogaudi.optimizations.fused_optimizer.hpu_format")  # used on HPU only


class HpuDelegates:
    """The unit's HPU path (mixed into :class:`~.unit.FusedOptimizer`, whose scope holds its hooks)."""

    def _attach_hpu_delegate(self, owner, instance, hyperparameters) -> None:
        params = [p for group in instance.param_groups for p in group["params"]]
        if not params:
            self._kept(owner, "it has no parameters yet")
            return
        delegate = self.run.backend.fused_optimizer(owner, params, hyperparameters)
        # Share the user's state and mirror their groups before each step: schedulers,
        # param_groups edits and checkpoints act on the user's object, the kernel sees the result.
        self._extra_settings[owner] = {
            key: value for key, value in delegate.defaults.items() if key not in instance.defaults
        }
        self._share_groups(instance, delegate)
        handles = (
            self.scope.hook(
                instance.register_state_dict_post_hook,
                functools.partial(hpu_format.torch_format_checkpoint, steps=self._group_steps),
            ),
            self.scope.hook(instance.register_load_state_dict_post_hook, hpu_format.int_steps),
        )
        hpu_format.int_steps(instance)
        self._delegates[instance] = (delegate, handles)
        self._route_steps(owner)
        if not self._getstate_wrapped:
            # A copy or pickle of the object carries torch's state (tensor steps from the group
            # counters), which a plain torch.optim object steps on correctly.
            self._getstate_wrapped = True
            self.scope.wrap(torch.optim.Optimizer, "__getstate__", self._torch_format_getstate)
        self._count_fused(+1)

    def _share_groups(self, instance, delegate) -> None:
        """Point the hpex optimizer at the user's state (``load_state_dict`` replaces that dict) and
        at one mirror per non-empty user group (it rejects empty ones): the user's current values
        (a scheduler's lr) plus its own settings and counters, kept across steps. A new group (or
        one ``load_state_dict`` rebuilt) starts its counter from its parameters' saved steps."""
        delegate.state = instance.state
        known = self._mirrors.setdefault(instance, {})
        extra = self._extra_settings[type(instance)]
        mirrors = self._mirrors[instance] = hpu_format.mirror_groups(
            instance.param_groups, instance.state, extra, known
        )
        delegate.param_groups = [mirror for _, mirror in mirrors.values()]

    def _group_steps(self, optimizer) -> dict:
        """The step count of each parameter, from its group's counter (the bridge keeps no other)."""
        return hpu_format.group_steps(self._mirrors.get(optimizer, {}))

    def _delegate_step(self, optimizer) -> None:
        done = False
        with self.fail_open():
            delegate = self._delegates[optimizer][0]
            self._share_groups(optimizer, delegate)  # add_param_group / load_state_dict may have run
            hpu_format.raw_step(delegate)(delegate)
            done = True
        if not done:  # the unit was reverted and the state handed back: take torch's own step
            self._raw_steps[type(optimizer)](optimizer)

    def _torch_format_getstate(self, wrapped, instance, args, kwargs):
        state = wrapped(*args, **kwargs)
        if instance not in self._delegates:
            return state
        return hpu_format.torch_format_state(state, self._group_steps(instance))

    def _hand_back(self, optimizer) -> bool:
        """Give an hpex-stepped optimizer back to torch: its state in torch's format, no hook of ours
        left on it. False where it was not one."""
        delegate = self._delegates.pop(optimizer, None)
        if delegate is None:
            return False
        hpu_format.torch_format_steps(optimizer, self._group_steps(optimizer))
        for handle in delegate[1]:
            handle.remove()
        self._mirrors.pop(optimizer, None)
        return True

    def _hand_state_back_to_torch(self) -> None:
        for optimizer in list(self._delegates):
            self._hand_back(optimizer)
