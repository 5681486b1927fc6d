"""The shape signature of what reaches a model: every tensor in its arguments (through dicts, tuples
and lists, keyword arguments by name), and which of their dimensions vary from call to call.

Why: a compiler (HPU lazy mode, ``torch.compile``, CUDA or HPU graphs) builds one graph per input
signature, so the number of distinct signatures is the number of graphs; where they vary says what
could make them fewer. The batch dimension varying alone (an epoch's short last batch) is not a
sequence length: padding it would change the batch's mean.
"""

from __future__ import annotations

import collections.abc

import torch


def named_tensors(value, path: str = "") -> list:
    """(path, tensor) for every tensor in ``value``: a mapping's keys and a sequence's indices make the path."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if isinstance(value, collections.abc.Mapping):
        return [found for key, item in value.items() for found in named_tensors(item, _join(path, key))]
    if isinstance(value, (tuple, list)):
        return [found for index, item in enumerate(value) for found in named_tensors(item, _join(path, index))]
    return []


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def signature(args, kwargs) -> tuple:
    """The call's signature: (path, shape, dtype) of each tensor, hashable."""
    return tuple((path, tuple(t.shape), str(t.dtype)) for path, t in named_tensors([list(args), dict(kwargs)]))


def varying_dims(signatures) -> dict:
    """{path: the dimensions whose size differs between ``signatures``} for the paths every one has
    at the same rank; a path that comes and goes, or changes rank, is {-1}."""
    shapes: dict = collections.defaultdict(set)
    for sig in signatures:
        for path, shape, _ in sig:
            shapes[path].add(shape)
    varying = {}
    for path, seen in shapes.items():
        ranks = {len(shape) for shape in seen}
        if len(ranks) > 1:
            varying[path] = {-1}
            continue
        dims = {dim for dim in range(ranks.pop()) if len({shape[dim] for shape in seen}) > 1}
        if dims:
            varying[path] = dims
    return varying


def where_it_varies(signatures) -> str:
    """``static`` (one signature), ``batch`` (only the first dimension varies: an epoch's end),
    ``sequence`` (the second dimension varies, alone or with the first) or ``other``."""
    varying = varying_dims(signatures)
    dims = set().union(*varying.values()) if varying else set()
    if not dims:
        return "static"
    if dims == {0}:
        return "batch"
    if dims <= {0, 1}:
        return "sequence"
    return "other"
