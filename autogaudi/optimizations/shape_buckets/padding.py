"""Pad a batch up to a bucket length where the batch itself says which positions are padding, and cut
a model's per-position outputs back to the length the script gave.

Why each fill: an attention mask's new positions are 0 (masked); per-position labels get the ignore
index that torch's and Hugging Face's losses skip; every other tensor along the sequence (token ids,
token types) gets the value the batch already holds at its masked positions, or the embedding's
``padding_idx``. Where no value is known, the batch is left as it is. The outputs are cut back so
that the script sees the shapes it would have seen: only the model's call is padded, never the batch.
Where the device compiles every op's shapes into its graph (HPU lazy mode), the batch is read and
padded on the host and copied back: on the device, the padding's own ops would meet every length.
"""

from __future__ import annotations

import collections.abc
import inspect

import torch
import torch.utils._pytree as pytree

from autogaudi.optimizations.shape_buckets.signature import named_tensors

IGNORE_INDEX = -100  # torch's cross_entropy default and Hugging Face's label padding
LABEL_NAMES = ("labels", "label")
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class NotPadded(Exception):
    """Why a call cannot be padded: ``code`` a reason code of the unit's; ``lasting`` False where a
    later call may well be (no fill value known yet)."""

    def __init__(self, code: str, lasting: bool = True, **params):
        super().__init__(code)
        self.code, self.lasting, self.params = code, lasting, params


def argument_names(forward, args: tuple) -> list:
    """The names of ``forward``'s positional parameters ``args`` fill (an index where none is known)."""
    try:
        names = [p.name for p in inspect.signature(forward).parameters.values() if p.kind in POSITIONAL]
    except (TypeError, ValueError):
        names = []
    return [names[i] if i < len(names) else str(i) for i in range(len(args))]


def _leaf(path: str) -> str:
    return path.rsplit(".", 1)[-1]


def find_mask(named: list):
    """(path, mask) of the attention mask: a 2-D tensor named ``*mask*`` holding 0s and 1s; None where none."""
    masks = [
        (path, t) for path, t in named if "mask" in _leaf(path) and t.dim() == 2 and bool(((t == 0) | (t == 1)).all())
    ]
    masks.sort(key=lambda found: _leaf(found[0]) != "attention_mask")
    return masks[0] if masks else None


def fills(named: list, known: dict, padding_idx) -> tuple:
    """(rows, length, {path: fill value}) for the tensors along the mask's sequence dimension; ``known``
    (path -> fill) is updated with the fills this batch shows. Raises :class:`NotPadded`."""
    found = find_mask(named)
    if found is None:
        raise NotPadded("no_mask")
    mask_path, mask = found
    rows, length = mask.shape
    masked = mask == 0
    plan = {}
    for path, t in named:
        if t.dim() < 2 or t.shape[0] != rows:
            continue
        if t.shape[1] != length:
            if length in t.shape[2:]:
                raise NotPadded("length_elsewhere", path=path)
            continue
        if path == mask_path:
            plan[path] = False if t.dtype == torch.bool else 0
        elif _leaf(path) in LABEL_NAMES:
            if t.is_floating_point():
                raise NotPadded("float_labels", path=path)
            plan[path] = IGNORE_INDEX
        else:
            plan[path] = _fill_of(path, t, masked, known, padding_idx)
    return rows, length, plan


def _fill_of(path: str, tensor, masked, known: dict, padding_idx):
    at_masked = tensor[masked]
    if at_masked.numel():
        values = at_masked.unique()
        if values.numel() != 1:
            raise NotPadded("fill_not_constant", path=path)
        known[path] = values.item()
    elif path not in known:
        if padding_idx is None or tensor.is_floating_point():
            raise NotPadded("fill_unknown", lasting=False, path=path)
        known[path] = padding_idx
    return known[path]


def embedding_padding_idx(model):
    """The ``padding_idx`` of the model's first embedding that has one, or None."""
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
            return module.padding_idx
    return None


def padded(value, plan: dict, bucket: int, path: str = "", via_host: bool = False):
    """``value`` (an argument, with its dicts, tuples and lists) with the tensors ``plan`` names padded
    along their second dimension up to ``bucket`` (on the host and copied back, ``via_host``)."""
    if isinstance(value, torch.Tensor):
        if path not in plan:
            return value
        source = value.cpu() if via_host else value
        missing = list(value.shape)
        missing[1] = bucket - value.shape[1]
        result = torch.cat([source, source.new_full(missing, plan[path])], dim=1)
        return result.to(value.device) if via_host else result
    if isinstance(value, collections.abc.Mapping):
        return type(value)({key: padded(item, plan, bucket, _join(path, key), via_host) for key, item in value.items()})
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(padded(item, plan, bucket, _join(path, i), via_host) for i, item in enumerate(value))
    return value


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def named_arguments(forward, args: tuple, kwargs: dict, via_host: bool = False) -> list:
    """(path, tensor) of a call's tensors, the path starting with the parameter's name (those of two
    or more dimensions copied to the host, ``via_host``)."""
    names = argument_names(forward, args)
    named = named_tensors(dict(zip(names, args))) + named_tensors(kwargs)
    return [(path, t.cpu() if via_host and t.dim() >= 2 else t) for path, t in named]


def padded_call(forward, args: tuple, kwargs: dict, plan: dict, bucket: int, via_host: bool = False) -> tuple:
    """(args, kwargs) of the call padded up to ``bucket``."""
    names = argument_names(forward, args)
    return (
        tuple(padded(arg, plan, bucket, name, via_host) for name, arg in zip(names, args)),
        {key: padded(value, plan, bucket, key, via_host) for key, value in kwargs.items()},
    )


def cut_back(output, rows: int, length: int, bucket: int):
    """``output`` with its per-position tensors (``rows`` first, ``bucket`` second) cut back to
    ``length`` along the second dimension; whatever else is as it was. The shadow check holds this
    rule to the unpadded call's outputs, so a tensor that only happened to be ``bucket`` long fails it."""
    if length == bucket:
        return output
    leaves, spec = pytree.tree_flatten(output)
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.shape[0] == rows and leaf.shape[1] == bucket:
            leaves[index] = leaf[:, :length]
    return pytree.tree_unflatten(leaves, spec)


def marked_dynamic(forward, args: tuple, kwargs: dict, names: set) -> tuple:
    """(args, kwargs) with each tensor of two or more dimensions whose name is in ``names`` replaced by
    a view of it whose second dimension is marked dynamic for torch.compile (``mark_dynamic``): the
    script's own tensors are left unmarked."""

    def marked(value, path: str):
        if isinstance(value, torch.Tensor):
            if value.dim() < 2 or _leaf(path) not in names:
                return value
            view = value.view_as(value)
            torch._dynamo.mark_dynamic(view, 1)
            return view
        if isinstance(value, collections.abc.Mapping):
            return type(value)({key: marked(item, _join(path, key)) for key, item in value.items()})
        if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
            return type(value)(marked(item, _join(path, i)) for i, item in enumerate(value))
        return value

    names_of = argument_names(forward, args)
    return (
        tuple(marked(arg, name) for name, arg in zip(names_of, args)),
        {key: marked(value, key) for key, value in kwargs.items()},
    )
