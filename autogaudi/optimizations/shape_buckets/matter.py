"""Where input shapes matter: where a new shape is a new graph to compile, so that padding pays.

Why one place: shape_buckets (sequence lengths) and static_last_batch (an epoch's short last batch)
pad for the same reason, so they pad on the same runs. HPU lazy mode compiles every step's graph
from the first; the script's own ``torch.compile`` of the training model and graph capture (on the
model, or forced) compile per shape on any backend. An eager CPU or CUDA run pays nothing per shape.
"""

from __future__ import annotations

from autogaudi.watch.model_call import Layer, compiled_by_the_script, holder


def compiled_for_shapes(model, options):
    """How the training ``model``'s calls are compiled per input shape whatever the backend:
    ``torch.compile`` (the script's own), ``graph capture`` (on the model, or forced), else None."""
    if model is None:
        return None
    if compiled_by_the_script(model):
        return "torch.compile"
    if holder(model, Layer.CAPTURE) is not None or "graph_capture" in options.force:
        return "graph capture"
    return None


def where_shapes_matter(backend, model, options):
    """What compiles per shape on this run (``HPU``, or :func:`compiled_for_shapes`), or None."""
    return "HPU" if backend.name == "hpu" else compiled_for_shapes(model, options)
