"""autogaudi's own frames taken out of the tracebacks of the user's exceptions.

A user's exception (a ``__getitem__`` that raises, a Ctrl-C during a compile) passes through
autogaudi's wrappers on its way to the script: its traceback should read as in the plain run, which
has no such frames. Light on purpose: the launcher uses it before torch is imported.
"""

from __future__ import annotations

import os

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def is_own(filename: str) -> bool:
    return filename.startswith(_PACKAGE)


def strip_own_frames(error: BaseException) -> BaseException:
    """``error`` with autogaudi's frames spliced out of its traceback, and out of those of the
    exceptions it was raised from or during (python prints them with it)."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = _without_own(current.__traceback__)
        pending += [current.__cause__, current.__context__]
    return error


def _without_own(traceback):
    head = last = None
    while traceback is not None:
        if not is_own(traceback.tb_frame.f_code.co_filename):
            if last is None:
                head = traceback
            else:
                last.tb_next = traceback
            last = traceback
        traceback = traceback.tb_next
    if last is not None:
        last.tb_next = None
    return head
