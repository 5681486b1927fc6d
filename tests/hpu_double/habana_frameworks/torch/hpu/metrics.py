"""metric_global(name).stats() -> [(tag, value)], as the bridge's metrics API returns them."""

import contextlib

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


def _count_compilation(micros):
    """Not bridge API: the graph-capture double calls this whenever it "compiles" a new graph."""
    stats = _METRICS["graph_compilation"]
    stats["TotalNumber"] += 1
    stats["TotalTime"] += micros
    stats["AvgTime"] = stats["TotalTime"] / stats["TotalNumber"]
