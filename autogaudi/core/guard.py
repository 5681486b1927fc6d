"""The one fail-open boundary: every piece of autogaudi code that runs inside a user's call.

Why one: wrappers around torch functions, hooks on modules and tensors, dispatch modes, event
listeners and the model's call path all run *inside* the user's own calls. If any of them raises,
the user's call must complete exactly as plain PyTorch's would, the unit that raised must be
switched off and reported, and an exception from the user's own code must reach the user
unchanged. Written once here, a unit cannot get it wrong: the core registers every callable a unit
hands to torch through these functions, and a unit has no other way to hand torch one.

An *owner* (a unit, or the session's own watcher) has ``in_force`` (False once it failed: its
guarded code is skipped from then on) and ``failed_at_run_time(error)`` (switch it off, report it).
"""

from __future__ import annotations

import torch.utils.checkpoint

from autogaudi.entry.frames import strip_own_frames

# Exceptions torch raises through the user's calls on purpose, never autogaudi's failures: non-reentrant
# checkpointing stops its recomputation early with one. Running the call again would recompute past it.
PASSING_THROUGH = tuple(
    cls for cls in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),) if cls is not None
)


_FREE = object()  # guarded_call's wrappers take no instance


class _UserCall:
    """The user's call as a guarded wrapper sees it: remembers whether it ran, what it returned and
    what it raised, so the guard can tell the user's exception from autogaudi's and never runs the
    user's call twice."""

    __slots__ = ("wrapped", "ran", "result", "raised", "args", "kwargs")

    def __init__(self, wrapped, args: tuple, kwargs: dict):
        self.wrapped = wrapped
        self.args = args  # what the call is made with should the wrapper fail before running it
        self.kwargs = kwargs
        self.ran = False
        self.result = None
        self.raised = None

    def __call__(self, *args, **kwargs):
        try:
            self.result = self.wrapped(*args, **kwargs)
        except BaseException as error:
            self.raised = error
            raise
        finally:
            self.ran = True
        return self.result

    def instead(self, fn):
        """``fn`` as the user's call: a wrapper that routes the call elsewhere (another iterator's
        ``__next__``) keeps what it runs recorded."""
        self.wrapped = fn
        return self

    def read_as(self, *args, **kwargs) -> None:
        """The user's arguments as the wrapper had to read them (a generator of parameters, read
        into a list): should the wrapper fail, the user's call is made with these, not with what
        reading used up."""
        self.args, self.kwargs = args, kwargs


def guarded_call(owner, wrapper, wrapped, args: tuple, kwargs: dict):
    """``wrapper(call, args, kwargs)`` around the user's ``wrapped``, where ``call`` runs the user's
    call. An exception raised by the user's call propagates as it is; one raised by the wrapper's own
    code switches the owner off, and the user's call completes as without the wrapper: run now if the
    wrapper had not run it yet, its result returned if it had (a user's call never runs twice)."""
    return guarded_method_call(owner, wrapper, wrapped, _FREE, args, kwargs)


def guarded_method_call(owner, wrapper, wrapped, instance, args: tuple, kwargs: dict):
    """:func:`guarded_call` with ``wrapper(call, instance, args, kwargs)``: bound with
    ``functools.partial``, it is a wrapt wrapper with no frame of its own, so the user's exception
    reaches the script without any of autogaudi's frames (each is spliced out here)."""
    if not owner.in_force:
        return wrapped(*args, **kwargs)
    call = _UserCall(wrapped, args, kwargs)
    try:
        return wrapper(call, args, kwargs) if instance is _FREE else wrapper(call, instance, args, kwargs)
    except PASSING_THROUGH:
        raise
    except Exception as error:
        if call.raised is not None:
            if error is not call.raised:  # the wrapper replaced the user's exception: give it back
                owner.failed_at_run_time(error)
                raise strip_own_frames(call.raised) from None
            strip_own_frames(error)  # the user's traceback reads as without the wrapper
            raise
        owner.failed_at_run_time(error)
        if call.ran:
            return call.result
        return wrapped(*call.args, **call.kwargs)
    except BaseException as error:  # a Ctrl-C in the call or the wrapper: the user's, as it is
        strip_own_frames(error)
        raise
    finally:
        # The user's exception holds this frame in its traceback, and the frame holds ``call``: kept,
        # that cycle would keep the caller's frames alive (a loop's StopIteration every epoch, with
        # the DataLoaders and tensors in them) until the garbage collector ran, not until return.
        call.raised = None


def run_guarded(owner, fn, *args, fallback=None):
    """``fn(*args)`` while ``owner`` is in force; where it raises, the owner is switched off and
    ``fallback`` returned (for a hook: None, "change nothing"). For code that calls nothing of the
    user's: hooks, event listeners, a dispatch mode's bookkeeping."""
    if not owner.in_force:
        return fallback
    try:
        return fn(*args)
    except PASSING_THROUGH:
        raise
    except Exception as error:
        owner.failed_at_run_time(error)
        return fallback


def guarded(owner, fn):
    """``fn`` as a callable that runs through :func:`run_guarded` (a hook handed to torch)."""

    def run(*args):
        return run_guarded(owner, fn, *args)

    run.__wrapped__ = fn
    return run
