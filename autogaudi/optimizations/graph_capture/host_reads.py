"""Where the step profiler's host reads of device values sit in a model's forward: graphs that replay
recorded ops would replay a branch taken on such a value (graph_capture's control-flow refusal)."""

from __future__ import annotations

import inspect
import os


def read_sites(profiler) -> list:
    """(file, line) of each host read of a device value the step profiler located in its census steps
    (its ``host_read_sites`` figure, ``file:line (n/step)``, the file relative to the working folder)."""
    sites = []
    for text in profiler.report.figures.get("host_read_sites", ()) if profiler is not None else ():
        path, _, line = text.rsplit(" (", 1)[0].rpartition(":")
        if line.isdigit():
            sites.append((os.path.abspath(path), int(line)))
    return sites


def forward_reading(module, sites: list):
    """(the sub-module, its (file, line)) of the first of ``sites`` inside the source of the forward of
    ``module`` or of one of its sub-modules, or None. A read in a helper the forward calls is filed
    under the helper's line, and is not found here."""
    spans = {}  # forward function -> (file, first line, last line), or None where it has no source
    for sub in module.modules():
        forward = type(sub).forward
        if forward not in spans:
            try:
                lines, first = inspect.getsourcelines(forward)
                spans[forward] = (os.path.abspath(inspect.getsourcefile(forward)), first, first + len(lines) - 1)
            except (OSError, TypeError):
                spans[forward] = None
        span = spans[forward]
        for site in sites:
            if span and site[0] == span[0] and span[1] <= site[1] <= span[2]:
                return sub, site
    return None
