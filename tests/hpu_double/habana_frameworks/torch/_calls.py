"""Not part of the real bridge: the double's record of every bridge call, for the tests."""
CALLS = []
MEMORY = {"Limit": 96 * 1024 ** 3, "InUse": 0, "MaxInUse": 0, "NumAllocs": 0, "NumFrees": 0,
          "ActiveAllocs": 0, "MaxAllocSize": 0, "TotalSystemAllocs": 0, "TotalSystemFrees": 0,
          "TotalActiveAllocs": 0}


def record(name, **details):
    CALLS.append((name, details))


def names():
    return [name for name, _ in CALLS]


def reset():
    CALLS.clear()
