"""metric_global(name).stats() -> [(tag, value)], as the bridge's metrics API returns them."""

import contextlib
import hashlib
import os

from habana_frameworks.torch import _calls

_METRICS = {
    "graph_compilation": {"TotalNumber": 0, "TotalTime": 0, "AvgTime": 0},
    "cpu_fallback": {"TotalNumber": 0, "FallbackOps": {}},
    "memory_defragmentation": {"TotalNumber": 0, "TotalTime": 0},
    "recipe_cache": {"TotalHit": 0, "TotalMiss": 0},
}


# Not bridge API: every read of a metric, in order ((call, name)), kept apart from _calls.CALLS so
# that the call sequences other tests assert on stay the bridge's device work.
READS = []


class _Metric:
    def __init__(self, name):
        if name not in _METRICS:
            raise ValueError(f"unknown metric {name!r}")
        self.name = name

    def stats(self):
        READS.append(("stats", self.name))
        # copies: a caller keeping the list must not see later counts (the bridge builds a new list)
        return [(tag, dict(value) if isinstance(value, dict) else value) for tag, value in _METRICS[self.name].items()]


def metric_global(name):
    READS.append(("metric_global", name))
    return _Metric(name)


@contextlib.contextmanager
def metric_localcontext(name):
    yield _Metric(name)


# <dir>,<delete_on_start>,<max_MB>: the recipe disk cache, read once when the bridge loads.
RECIPE_CACHE = os.environ.get("PT_HPU_RECIPE_CACHE_CONFIG")


def _count_compilation(micros, key):
    """Not bridge API: the graph-capture double calls this whenever it "compiles" a new graph. With
    the recipe disk cache configured, a graph whose recipe is in its folder is a hit and compiles
    nothing; otherwise its recipe is written there."""
    if RECIPE_CACHE:
        folder = RECIPE_CACHE.split(",")[0]
        path = os.path.join(folder, hashlib.sha256(repr(key).encode()).hexdigest()[:20] + ".recipe")
        if os.path.exists(path):
            _METRICS["recipe_cache"]["TotalHit"] += 1
            return
        _METRICS["recipe_cache"]["TotalMiss"] += 1
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as handle:
            handle.write(repr(key))
    stats = _METRICS["graph_compilation"]
    stats["TotalNumber"] += 1
    stats["TotalTime"] += micros
    stats["AvgTime"] = stats["TotalTime"] / stats["TotalNumber"]


def inject_cpu_fallback(op, count=1):
    """Not bridge API: count ``count`` runs of ``op`` (an aten name, "aten::nonzero") on the CPU, as
    the bridge does for an op or dtype the device lacks; the double itself never falls back."""
    stats = _METRICS["cpu_fallback"]
    stats["TotalNumber"] += count
    stats["FallbackOps"][op] = stats["FallbackOps"].get(op, 0) + count
    _calls.record("inject_cpu_fallback", op=op, count=count)


def inject_compilation(micros=1000, key=None):
    """Not bridge API: one graph compilation as the bridge would count it, recipe cache included: for
    tests whose models stay on the host (the double compiles lazy graphs of HPU tensors' ops only)."""
    _calls.record("inject_compilation", micros=micros)
    _count_compilation(micros, key if key is not None else ("injected", _METRICS["graph_compilation"]["TotalNumber"]))
