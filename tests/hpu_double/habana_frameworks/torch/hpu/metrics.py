"""metric_global(name).stats() -> [(tag, value)], as the bridge's metrics API returns them."""

import contextlib
import hashlib
import os

_METRICS = {
    "graph_compilation": {"TotalNumber": 0, "TotalTime": 0, "AvgTime": 0},
    "cpu_fallback": {"TotalNumber": 0, "FallbackOps": {}},
    "memory_defragmentation": {"TotalNumber": 0, "TotalTime": 0},
    "recipe_cache": {"TotalHit": 0, "TotalMiss": 0},
}


class _Metric:
    def __init__(self, name):
        if name not in _METRICS:
            raise ValueError(f"unknown metric {name!r}")
        self.name = name

    def stats(self):
        return list(_METRICS[self.name].items())


def metric_global(name):
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
