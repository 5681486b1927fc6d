"""What each kind of entry autogaudi writes in its cache holds, and the check of an entry read back
against it (:func:`problem`). Plain data and one function, beside :mod:`autogaudi.store.cache`, which
reads and writes the entries: an entry that does not match is dropped with a note and measured
afresh."""

from __future__ import annotations


# What each kind of entry autogaudi writes in the cache holds, checked when it is read back: an entry
# that does not match is dropped with a note and measured afresh (a valid JSON file with a wrong
# field would otherwise steer every later run). A schema is a type (or tuple of types), a dict of
# the keys it needs (Maybe(...): a key that may be absent; other keys are allowed), ListOf, MapOf
# (any keys) or OneOf (one of these values).
class ListOf:
    def __init__(self, item):
        self.item = item


class MapOf:
    def __init__(self, value):
        self.value = value


class OneOf:
    def __init__(self, *values):
        self.values = values


class Maybe:
    def __init__(self, schema):
        self.schema = schema


NUMBER = (int, float)
FIGURES = {
    "ms_per_step": NUMBER,
    "input_wait_fraction": NUMBER,
    "ops_per_step": int,
    "compute_fraction": NUMBER,
    "compute_fraction_range": ListOf(NUMBER),
    "collective_wait_fraction": Maybe(NUMBER),
    "collectives_without_future_per_step": Maybe(NUMBER),
    "fp32_matrix_fraction": Maybe(NUMBER),
}
STAMP = {"run": int, "date": str}
PROFILE = {
    "bound": OneOf("input", "host", "communication", "device", "unclear"),
    "why": str,
    "figures": FIGURES,
    "calls_per_step": int,
    **STAMP,
}
TRIAL = {
    # "stopped": its one-off passed the estimate's high end before the arms were timed
    "decision": OneOf("kept", "rejected", "stopped"),
    "speedup": Maybe(NUMBER),
    "ms_per_step_with": Maybe(NUMBER),
    "ms_per_step_without": NUMBER,
    "one_off_limit_s": Maybe(NUMBER),
    "load": Maybe(NUMBER),
    **STAMP,
}
SCHEMAS = {
    "decisions": {
        "format": int,
        "setup": dict,
        "script": str,
        "model": str,
        "backend": str,
        "device": str,
        "profile": PROFILE,
        "trials": MapOf(TRIAL),
        "runs": int,
        "last_run_on": str,
    },
    "memory_decision": {
        "format": int,
        "setup": dict,
        "model": str,
        "blocks": list,
        "where": OneOf("forward", "outside_forward"),
        "step": int,
        "date": str,
    },
    "one_off": {
        "size": NUMBER,
        "actual_s": NUMBER,
        "warm": Maybe(bool),
        "tier": Maybe(OneOf("whole", "regional", "replay")),
        "predicted_s": Maybe(NUMBER),
        "load": Maybe(NUMBER),
        "date": Maybe(str),
    },
    "one_offs": {"records": list},  # each record checked alone: a bad one is dropped, not all
    "artifacts_index": {"key": MapOf((str, bool)), "blob": str, "sha256": str, "date": str},
}


def problem(value, schema, where: str = "entry"):
    """What in ``value`` does not match ``schema`` (the first thing found, where it is), or None."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            return f"{where} is not an object"
        for key, wanted in schema.items():
            if isinstance(wanted, Maybe):
                if value.get(key) is None:
                    continue
                wanted = wanted.schema
            elif key not in value:
                return f"{where}.{key} is missing"
            found = problem(value[key], wanted, f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(schema, ListOf):
        if not isinstance(value, list):
            return f"{where} is not a list"
        return next((p for i, item in enumerate(value) if (p := problem(item, schema.item, f"{where}[{i}]"))), None)
    if isinstance(schema, MapOf):
        if not isinstance(value, dict):
            return f"{where} is not an object"
        return next((p for key, item in value.items() if (p := problem(item, schema.value, f"{where}.{key}"))), None)
    if isinstance(schema, OneOf):
        return None if value in schema.values else f"{where} is {_shown(value)}, not one of {', '.join(schema.values)}"
    types = schema if isinstance(schema, tuple) else (schema,)
    # JSON's true is no number, though Python's bool is an int
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        return f"{where} is {_shown(value)}, not {'/'.join(t.__name__ for t in types)}"
    return None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
