"""Graph breaks and recompiles of what torch.compile captured, from torch's own records: dynamo's
``counters["graph_break"]`` (reason -> count; the reason names torch's graph-break code, ``GB0064``)
and its compilation metrics (one per frame compiled: the frame's file and first line, the guard that
failed where it was a recompile; the code dynamo resumes after a break is named for the break's line).
Why: each break runs part of the step eagerly and each recompile is a compile more; the report names
them where the user can act, in torch's words."""

from __future__ import annotations

import os
import re
import sys

_CODE = re.compile(r"/gb/(gb\d+)\.html", re.IGNORECASE)
_RESUMED = re.compile(r"torch_dynamo_resume_in_(\w+?)_at_(\d+)$")
_LISTED = 5  # the most distinct reasons the figures name (the counts cover all)


def _dynamo_utils():
    return sys.modules.get("torch._dynamo.utils")  # not imported: nothing was compiled


def mark():
    """Where torch's records stand now: (graph breaks by reason, the compilation metrics seen)."""
    utils = _dynamo_utils()
    if utils is None:
        return {}, set()
    return dict(utils.counters["graph_break"]), {id(entry) for entry in utils.get_compilation_metrics()}


def _where(entry) -> str:
    return f"{os.path.basename(entry.co_filename or '?')}:{entry.co_firstlineno} ({entry.co_name})"


def _first_line(text: str) -> str:
    return " ".join(text.strip().splitlines()[0].split()) if text and text.strip() else "?"


def since(marked) -> dict:
    """Graph breaks and recompiles since :func:`mark`: ``{"graph_breaks": {"count", "reasons": [{"code",
    "reason", "count"}], "where": [file:line of the frames that broke]}, "recompiles": {"count",
    "reasons": [{"reason", "where"}]}}``, counts 0 where torch compiled nothing."""
    breaks_before, seen = marked
    utils = _dynamo_utils()
    found = {"graph_breaks": {"count": 0, "reasons": [], "where": []}, "recompiles": {"count": 0, "reasons": []}}
    if utils is None:
        return found
    for reason, count in utils.counters["graph_break"].items():
        new = count - breaks_before.get(reason, 0)
        if new <= 0:
            continue
        found["graph_breaks"]["count"] += new
        code = _CODE.search(reason)
        if len(found["graph_breaks"]["reasons"]) < _LISTED:
            found["graph_breaks"]["reasons"].append(
                {"code": code.group(1).upper() if code else None, "reason": _first_line(reason), "count": new}
            )
    for entry in utils.get_compilation_metrics():
        if id(entry) in seen:
            continue
        resumed = _RESUMED.match(entry.co_name or "")
        if resumed:  # dynamo resumes after a break in code named for the break's line
            where = f"{os.path.basename(entry.co_filename or '?')}:{resumed.group(2)} ({resumed.group(1)})"
            if where not in found["graph_breaks"]["where"]:
                found["graph_breaks"]["where"].append(where)
        if entry.recompile_reason:
            found["recompiles"]["count"] += 1
            if len(found["recompiles"]["reasons"]) < _LISTED:
                found["recompiles"]["reasons"].append(
                    {"reason": _first_line(entry.recompile_reason), "where": _where(entry)}
                )
    return found
