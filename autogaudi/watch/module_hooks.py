"""torch's global module forward hooks, for autogaudi's watchers, kept out of the modules the script
compiled itself.

Why: the step watcher (evaluation passes), the step profiler (the outermost module of a census step)
and the doctor's observer watch module calls they cannot name in advance, through torch's global
forward hooks. A script's own ``torch.compile(model)`` returns an ``OptimizedModule`` whose
``__call__`` warns whenever any global module hook exists (a ``UserWarning`` a plain run never
prints), and dynamo, inlining the compiled module's submodule calls, would trace those hooks into
the script's graphs and guard on them. So while autogaudi has such hooks,
``OptimizedModule.__call__`` is wrapped, as soon as dynamo is loaded (now, or right after the
script's first ``torch.compile`` imports it: a module compiled before or after the hooks exist is
covered alike): for the length of each call autogaudi's hooks move from torch's global dictionaries
onto the called ``OptimizedModule`` (torch runs them in its own ``_call_impl``, where the global
ones would have run, and dynamo never sees them) and back to the global ones after. The script's own
global hooks stay where they are. The wrapper (and the wait for dynamo's import) is in place while a
hook is registered here or a watcher keeps it (:func:`keep`: one that registers and removes a hook per
module call must not wrap and unwrap ``OptimizedModule.__call__`` each time: with no hook held it
only calls through); the last release takes it off, so ``disable()`` leaves
``OptimizedModule.__call__`` the very original object.
"""

from __future__ import annotations

from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from autogaudi.core.guard import guarded_call
from autogaudi.entry.import_watch import call_after_import, forget_after_import

_HELD: list = []  # the hooks registered here, in the order they were
_KEEPERS: list = []  # the watchers keeping the OptimizedModule wrapper between their hooks (see keep())
_unwrap = None  # while _HELD is not empty and dynamo is loaded: what takes the OptimizedModule wrapper off
EVAL_FRAME = "torch._dynamo.eval_frame"  # where OptimizedModule is defined


class _Hook:
    """One global hook: torch's handle of it (global, or on the compiled module it moved to)."""

    def __init__(self, fn, pre: bool):
        self.fn = fn
        self.pre = pre
        self.moved = False  # on a compiled module for the length of its call
        self.removed = False
        self._handle = self._register(None)

    def _register(self, module):
        if self.pre:
            register = register_module_forward_pre_hook if module is None else module.register_forward_pre_hook
            return register(self.fn)
        register = register_module_forward_hook if module is None else module.register_forward_hook
        return register(self.fn, always_call=True)

    def move_to(self, module) -> None:
        self._handle.remove()
        self.moved = True
        self._handle = self._register(module)

    def move_back(self) -> None:
        self._handle.remove()
        self.moved = False
        self._handle = self._register(None)

    def remove(self) -> None:
        """Removes the hook, wherever it is (a RemovableHandle's ``remove``: a second call does nothing)."""
        if self.removed:
            return
        self.removed = True
        self._handle.remove()
        _HELD.remove(self)
        if not _HELD and not _KEEPERS:
            _release()


def register_forward_pre_hook(hook) -> _Hook:
    """``register_module_forward_pre_hook(hook)``, kept out of compiled modules' calls (see above)."""
    return _hold(_Hook(hook, pre=True))


def register_forward_hook(hook, always_call: bool = True) -> _Hook:
    """``register_module_forward_hook(hook, always_call=True)``, kept out of compiled modules' calls."""
    if not always_call:
        raise ValueError("autogaudi's global forward hooks are always called")
    return _hold(_Hook(hook, pre=False))


def keep():
    """Keep the ``OptimizedModule`` wrapper in place until the returned release runs, whether or not
    a hook is held meanwhile: for a watcher that registers and removes its hooks call by call."""
    keeper = object()
    _KEEPERS.append(keeper)
    if len(_KEEPERS) == 1 and not _HELD:
        call_after_import(EVAL_FRAME, _wrap_compiled_calls)

    def release() -> None:
        if keeper in _KEEPERS:
            _KEEPERS.remove(keeper)
            if not _KEEPERS and not _HELD:
                _release()

    return release


def _hold(hook: _Hook) -> _Hook:
    _HELD.append(hook)
    if len(_HELD) == 1 and not _KEEPERS:  # now, or once the script's torch.compile loads dynamo
        call_after_import(EVAL_FRAME, _wrap_compiled_calls)
    return hook


def _wrap_compiled_calls(eval_frame) -> None:
    global _unwrap
    if (_HELD or _KEEPERS) and _unwrap is None:  # not where everything was released while dynamo loaded
        from autogaudi.core.unit import wrap_attribute

        _unwrap = wrap_attribute(eval_frame.OptimizedModule, "__call__", _compiled_call)


def _release() -> None:
    global _unwrap
    forget_after_import(EVAL_FRAME, _wrap_compiled_calls)
    unwrap, _unwrap = _unwrap, None
    if unwrap is not None:
        unwrap()


class _Mover:
    """The guard's owner of the wrapper's own code: where moving a hook raised, the hooks stay global
    from then on (torch warns, as it would for anyone's global hooks) and the call runs as plain."""

    failure = None

    @property
    def in_force(self) -> bool:
        return self.failure is None

    def failed_at_run_time(self, error: Exception) -> None:
        if self.failure is None:
            from autogaudi.core.unit import warn

            self.failure = repr(error)
            warn(f"moving its module hooks onto a compiled module raised {self.failure}; they stay global")


_MOVER = _Mover()


def _compiled_call(wrapped, instance, args, kwargs):
    if not _HELD:  # kept between a watcher's hooks: nothing to move
        return wrapped(*args, **kwargs)
    return guarded_call(_MOVER, lambda call, a, kw: _moved_for_the_call(call, instance, a, kw), wrapped, args, kwargs)


def _moved_for_the_call(call, module, args, kwargs):
    moved = []
    try:
        for hook in list(_HELD):
            if not hook.moved:  # a compiled module inside another's call: moved already
                moved.append(hook)
                hook.move_to(module)
        return call(*args, **kwargs)
    finally:
        for hook in moved:
            if not hook.removed:  # the step watcher's hook steps aside inside the call it sees
                hook.move_back()
