"""DistributedDataParallel built with the settings the Gaudi guide and optimum-habana use, where the
script left them at torch's defaults.

Why: ``gradient_as_bucket_view=True`` makes each gradient a view into DDP's communication bucket,
which saves a copy per parameter per step and the memory of a second gradient copy.
Skipping the re-broadcast of module buffers before every forward — only when the model has no
buffers at all (BatchNorm statistics, for one, must stay in sync) — is spelt
``forward_sync_buffers=False`` on torch versions that have it (``broadcast_buffers`` is deprecated
there and would make DDP print a warning the plain run does not), else ``broadcast_buffers=False``. On HPU the
bucket size follows the model's gradient size as the Gaudi guide does (ResNet50 ~100 MB, ResNeXt101
~200 MB, optimum-habana 230 MB), halved for models under 50 MB so that there are at least two
buckets to overlap with the backward pass; CUDA and CPU keep torch's 25 MB (tuned for NCCL/gloo).
Never changed: any argument the script passed (positionally or by name), ``find_unused_parameters``
and ``static_graph`` (both need proof from a first step, and torch refuses ``static_graph`` once a
step has run: ``set_static_graph() should be called before training loop starts``; the report
suggests it where the script asked DDP to search for unused parameters), and DDP subclasses. The
maths is unchanged: gradients are the same all-reduced values.
"""

from __future__ import annotations

import inspect

from torch.nn.parallel import DistributedDataParallel

from autogaudi.core.unit import ROUNDING, Unit, UnitSpec

MB = 1024**2


def gradient_megabytes(module) -> float:
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad) / MB


def hpu_bucket_megabytes(module) -> int:
    size = gradient_megabytes(module)
    return max(1, round(min(230.0, size / 2 if size < 50 else size)))


class DdpTuning(Unit):
    spec = UnitSpec(
        reasons={
            "bucket_view": "gradient_as_bucket_view",
            "bucket_view_and_size": "gradient_as_bucket_view, bucket size from the model",
            "static_graph_advice": "find_unused_parameters=True: DDP searches the autograd graph for unused parameters "
            "every step; if the same parameters are used in every step, static_graph=True skips that search. torch "
            "accepts it only before the first step, before autogaudi could see the steps, so it is left to you",
            "kept_own_settings": "kept the script's own {settings}",
        },
        changed_figure=("ddp_models_tuned", "{} DistributedDataParallel model(s) tuned"),
        targets=("torch.nn.parallel.DistributedDataParallel.__init__",),
        exact_when="there are two ranks",  # on HPU
    )

    @classmethod
    def numerics_on(cls, backend) -> tuple:
        # On HPU it sizes DDP's buckets: each gradient lands elsewhere in the all-reduce's chunks, so
        # more than two ranks' values can be summed in another order (by reading). Elsewhere the
        # all-reduced values are the same, read through views.
        return (ROUNDING,) if backend.name == "hpu" else ()

    def apply(self) -> None:
        self._signature = inspect.signature(DistributedDataParallel.__init__)
        self._buffer_sync = (
            "forward_sync_buffers" if "forward_sync_buffers" in self._signature.parameters else "broadcast_buffers"
        )
        self.report.figures["ddp_models_tuned"] = 0
        self.scope.wrap(DistributedDataParallel, "__init__", self._init)
        self.report.because("bucket_view_and_size" if self.run.backend.name == "hpu" else "bucket_view")

    def _init(self, wrapped, instance, args, kwargs):
        changes = self._choose(args, kwargs) if type(instance) is DistributedDataParallel else {}
        return wrapped(*args, **{**kwargs, **changes})

    def _choose(self, args, kwargs) -> dict:
        try:
            given = self._signature.bind(None, *args, **kwargs).arguments
        except TypeError:  # the script's call is wrong: DDP raises its own error
            return {}
        module = given["module"]
        changes = {}
        if "gradient_as_bucket_view" not in given:
            changes["gradient_as_bucket_view"] = True
        buffer_choice = {"broadcast_buffers", "forward_sync_buffers"} & set(given)
        if not buffer_choice and next(module.buffers(), None) is None:
            changes[self._buffer_sync] = False
        if self.run.backend.name == "hpu" and "bucket_cap_mb" not in given:
            changes["bucket_cap_mb"] = hpu_bucket_megabytes(module)
        if given.get("find_unused_parameters") and "static_graph" not in given:
            self.report.note("static_graph_advice")
        kept = sorted(name for name in ("gradient_as_bucket_view", "bucket_cap_mb", *buffer_choice) if name in given)
        if kept:
            self.report.note("kept_own_settings", settings=", ".join(kept))
        self.report.figures["ddp_models_tuned"] += 1
        self.report.figures["last_settings"] = dict(changes)
        return changes
