"""Shapes that never recompile: where a sequence length varies from batch to batch and the batch says
which positions are padding, the training model's calls are padded up to a few bucket lengths.

Why: every new input shape is a new graph to compile under HPU lazy mode, ``torch.compile`` and
CUDA or HPU graphs; a collator that pads each batch to its own longest sequence makes one per batch.
Only where shapes matter (HPU, graph capture on or forced, the script's own ``torch.compile``): an
eager CPU or CUDA run pays nothing per shape, and nothing is padded.

How: the shapes of the DataLoader batches are read from the first one (``signature``); once the
step is profiled, the lengths seen choose the buckets (``buckets``: fewest padded positions for at
most ``MAX_GRAPHS`` graphs), and the inputs layer of the model's call (:mod:`autogaudi.watch.model_call`)
pads each call (``padding``: mask 0, labels the ignore index, ids the batch's own padding value) and
cuts per-position outputs back, so the script's batch and what it gets back keep their shapes.
Evaluation calls go into the same buckets. Nothing is padded before a shadow check (``check``) on a
copy found the padded call's outputs and gradients within its tolerance of the unpadded one's: a
model that does not mask its padding (an unmasked mean) is refused with a reason and runs as plain;
under the script's own ``torch.compile`` its varying sequence dimension is marked dynamic instead
(``mark_dynamic`` on views: one graph for every length, within torch's own recompile limit).
Under ``--exact`` it steps aside: a longer row sums in another order. The figures: the ``shapes``
section of the report (docs/units/shape_buckets.md).
"""

from __future__ import annotations

import sys

import torch

from autogaudi.core.events import Event
from autogaudi.core.registry import PROFILER
from autogaudi.core.unit import RANDOM, ROUNDING, Unit, UnitSpec
from autogaudi.optimizations.shape_buckets import buckets, check, matter, padding, signature
from autogaudi.watch.model_call import Layer, holder, trains

MAX_GRAPHS = 8  # the most graphs the buckets may cost, one more batch size (a short last batch) included
LENGTHS_KEPT = 256  # batches whose lengths are kept to choose buckets from


def compiled_graphs(backend):
    """Graphs compiled in this process, or None before any compile: on HPU the bridge's own count
    (``graph_compilation``: lazy mode's graphs, HPU graphs, its torch.compile backend's), elsewhere
    Dynamo's (``unique_graphs``)."""
    if backend.name == "hpu":
        metrics = sys.modules.get("habana_frameworks.torch.hpu.metrics")
        return None if metrics is None else dict(metrics.metric_global("graph_compilation").stats())["TotalNumber"]
    utils = sys.modules.get("torch._dynamo.utils")
    return None if utils is None else utils.counters["stats"]["unique_graphs"]


def short_last_batch(iterator) -> bool:
    """Whether the DataLoader behind ``iterator`` ends its epochs with a short batch."""
    sampler = getattr(iterator, "_index_sampler", None)
    try:
        return not sampler.drop_last and len(sampler.sampler) % sampler.batch_size != 0
    except (AttributeError, TypeError):
        return False


class ShapeBuckets(Unit):
    spec = UnitSpec(
        requires=(PROFILER,),
        after=("graph_capture",),  # decides once capture has taken the model (or refused it)
        numerics=(ROUNDING, RANDOM),  # a longer row sums in another order; dropout draws over the padded shape
        reasons={
            "eager": "nothing padded: shapes cost nothing on this eager {backend} run (no graph capture, "
            "torch.compile or HPU)",
            "no_batches": "no DataLoader batches seen before the profile: no lengths to choose buckets from",
            "static_shapes": "the batches' shapes did not vary",
            "batch_only": "only the batch dimension varies (an epoch's short last batch): padding it would change "
            "the batch's mean",
            "varies_elsewhere": "shapes vary along {paths}, not a sequence dimension",
            "inputs_held": "not padded: {holder} holds the model's inputs",
            "traced": "not padded: the script's torch.compile traces {model}'s call from a module around it",
            "checking": "padding up to {buckets}: waiting for a training call to check it on a copy of {model}",
            "bucketed": "{model}'s sequence lengths padded up to {buckets}, checked on a copy: {difference} relative",
            "no_mask": "not padded: the sequence length varies, but no attention mask says which positions are padding",
            "length_elsewhere": "not padded: {path} has the sequence length in another dimension",
            "float_labels": "not padded: {path} holds per-position float targets (no ignore index)",
            "fill_not_constant": "not padded: {path} holds different values at masked positions (no padding "
            "value to copy)",
            "outputs_reshaped": "not padded: {model}'s outputs change shape with padding, not only along the sequence",
            "padding_moves_result": "not padded: padding moved {model}'s outputs or gradients by {difference} "
            "(tolerance {tolerance}); its result depends on the padded positions (an unmasked mean?)",
            "check_failed": "not padded: the check on a copy of {model} could not run ({error})",
            "bucket_added": "a length past every bucket: bucket {bucket} added",
            "marked_dynamic": "not padded ({refused}): {model}'s sequence dimension of {names} marked dynamic for "
            "its torch.compile instead (one graph for every length, up to torch's recompile limit)",
        },
        acts_for_device=True,  # a model left on the host runs eagerly there, whatever the backend
        acts_on=("<training model> call route, inputs layer (sequence tensors padded, outputs cut back)",),
    )

    # The shadow check, as the measurement runner reads it once padding is set up: deciding until the
    # check passed (a difference kept) or refused padding (the layer gone, or the dimension marked dynamic).
    deciding = property(lambda self: self._scope is not None and self._checked is None and not self._dynamic)
    done = property(lambda self: not self.deciding)

    def apply(self) -> None:
        self._before: set = set()  # signatures of the DataLoader batches: what the script produced
        self._after: set = set()  # signatures of the calls that reached the model while held
        self._lengths: list = []  # the batches' sequence lengths, until buckets are chosen
        self._short_last = False
        self._model = self._scope = self._forward = None
        self._buckets: tuple = ()
        self._met: set = set()  # buckets met by training calls since bucketing began
        self._fills: dict = {}  # path -> the padding value the batches showed
        self._padding_idx = None
        self._checked = None  # the check's relative difference, once it passed
        self._refused = False
        self._dynamic = None  # names of the tensors whose sequence dimension is marked dynamic, where padding is not
        self._traced = False  # a call of the model was traced by the script's own torch.compile
        self._positions = self._padded = 0
        self._graphs_at = {}  # "start", "warm": compiled_graphs() then
        self.report.figures["shapes"] = self._shapes()
        self.scope.on(Event.BATCH_FETCHED, self._fetched)
        self.scope.on(Event.STEP_PROFILED, self._profiled)
        self.report.because("waiting_for_profile")

    def _shapes(self) -> dict:
        graphs = compiled_graphs(self.run.backend) if self._graphs_at else None  # read once bucketing began
        start, warm = self._graphs_at.get("start"), self._graphs_at.get("warm")
        return {
            "distinct_before": len(self._before),
            "distinct_after": len(self._after) if self._scope is not None else len(self._before),
            "varies": signature.where_it_varies(self._before),
            "buckets": list(self._buckets),
            "padded_fraction": round(self._padded / self._positions, 4) if self._positions else 0.0,
            "compilations": None if graphs is None or start is None else graphs - start,
            "compilations_after_warmup": None if graphs is None or warm is None else graphs - warm,
        }

    def _fetched(self, iterator, batch, _seconds) -> None:
        shape = signature.signature((batch,), {})
        if shape not in self._before:
            self._before.add(shape)
            self.report.figures["shapes"] = self._shapes()
        if self._model is None and len(self._lengths) < LENGTHS_KEPT:
            found = padding.find_mask(signature.named_tensors(batch))
            if found is not None:
                self._lengths.append(found[1].shape[1])
            self._short_last = self._short_last or short_last_batch(iterator)

    def _where_shapes_matter(self, model):
        return matter.where_shapes_matter(self.run.backend, model, self.run.options)

    def _profiled(self, profile) -> None:
        model = profile.model
        if model is None:
            self._settle("no_training_model")
            return
        varies = signature.where_it_varies(self._before)
        if not self._before:
            self._settle("no_batches")
        elif varies != "sequence":
            code = {"static": "static_shapes", "batch": "batch_only"}.get(varies, "varies_elsewhere")
            self._settle(code, paths=sorted(signature.varying_dims(self._before)))
        elif holder(model, Layer.INPUTS) is not None:
            self._settle("inputs_held", holder=holder(model, Layer.INPUTS).name)
        elif self._where_shapes_matter(model) is None:
            self.report.because("eager", backend=self.run.backend.name)
            self._model = model
            self.run.trials.measured(self)
            self.scope.on(Event.TRAINING_STEP, self._watch_for_capture)
        else:
            self._start(model)

    def _watch_for_capture(self, _optimizer) -> None:
        """Graph capture may take the model later (a trial that waited for its step): bucket from then on."""
        if self._scope is None and not self._refused and self._where_shapes_matter(self._model) is not None:
            self._start(self._model)

    def _settle(self, code: str, **params) -> None:
        self._refused = True
        self.run.trials.measured(self)
        self.report.because(code, **params)

    def _start(self, model) -> None:
        self._model = model
        most = MAX_GRAPHS - 1 if self._short_last else MAX_GRAPHS
        self._buckets = buckets.choose(self._lengths, most) if self._lengths else ()
        self._padding_idx = padding.embedding_padding_idx(model)
        self._forward = getattr(model, "_orig_mod", model).forward  # names the arguments (a compiled module's own)
        self._graphs_at["start"] = compiled_graphs(self.run.backend) or 0
        self._scope = self.scope.child()
        self.run.trials.measuring(self, self)  # deciding until the shadow check passed or refused padding
        self._scope.hold(model, Layer.INPUTS, self._around)
        self._scope.on(Event.TRAINING_STEP, self._stepped)
        self.report.because("checking", buckets=list(self._buckets), model=type(model).__name__)
        self.report.figures["shapes"] = self._shapes()

    def _refuse(self, code: str, **params) -> None:
        """Padding not provable for this model: the layer goes, the model runs as the script calls it;
        under the script's own torch.compile its sequence dimension is marked dynamic instead."""
        self._settle(code, model=type(self._model).__name__, **params)
        varying = signature.varying_dims(self._before)
        self._dynamic = {path.rsplit(".", 1)[-1] for path, dims in varying.items() if 1 in dims}
        if (
            code != "traced"
            and self._dynamic
            and matter.compiled_for_shapes(self._model, self.run.options) == "torch.compile"
        ):
            self.report.because(
                "marked_dynamic", refused=code, names=sorted(self._dynamic), model=type(self._model).__name__
            )
        else:
            self._dynamic = None
            self._scope.close()
            self._scope = None
        self.report.figures["shapes"] = self._shapes()

    def _stepped(self, _optimizer) -> None:
        if self._traced:
            self._refuse("traced")
            return
        if "warm" not in self._graphs_at and self._checked is not None and self._met >= set(self._buckets):
            self._graphs_at["warm"] = compiled_graphs(self.run.backend) or 0
        self.report.figures["shapes"] = self._shapes()

    def _bucket(self, length: int) -> int:
        bucket = buckets.bucket_for(length, self._buckets)
        if bucket is None:
            bucket = buckets.overflow(length)
            self._buckets = tuple(sorted({*self._buckets, bucket}))
            self.report.note("bucket_added", bucket=bucket)
        return bucket

    def _around(self, call, args, kwargs):
        """The inputs layer: the call padded up to its bucket, its per-position outputs cut back."""
        model = self._model
        if torch.compiler.is_compiling():  # the script's torch.compile traces this call: left as it is
            self._traced = True
            return call(*args, **kwargs)
        if self._dynamic:
            marked_args, marked_kwargs = padding.marked_dynamic(self._forward, args, kwargs, self._dynamic)
            return call(*marked_args, **marked_kwargs)
        via_host = self.run.backend.name == "hpu" and self.run.backend.is_lazy  # every op's shapes make its graph
        try:
            rows, length, plan = padding.fills(
                padding.named_arguments(self._forward, args, kwargs, via_host), self._fills, self._padding_idx
            )
        except padding.NotPadded as why:
            if why.lasting:
                self._refuse(why.code, **why.params)
            return call(*args, **kwargs)
        bucket = self._bucket(length)
        training = trains(model)
        if bucket == length or (self._checked is None and not training):
            # nothing to pad, or nothing padded before a training call is checked
            self._reached(args, kwargs, rows, length, length, training)
            return call(*args, **kwargs)
        padded_args, padded_kwargs = padding.padded_call(self._forward, args, kwargs, plan, bucket, via_host)
        checked = self._checked is not None or self._check(
            (args, kwargs), (padded_args, padded_kwargs), rows, length, bucket
        )
        if not checked:
            return call(*args, **kwargs)
        self._reached(padded_args, padded_kwargs, rows, length, bucket, training)
        return padding.cut_back(call(*padded_args, **padded_kwargs), rows, length, bucket)

    def _reached(self, args, kwargs, rows: int, length: int, bucket: int, training: bool) -> None:
        """A call reached the model with ``args``/``kwargs``: ``length`` padded up to ``bucket``."""
        if training and bucket in self._buckets:
            self._met.add(bucket)
        self._after.add(signature.signature(args, kwargs))
        self._positions += rows * bucket
        self._padded += rows * (bucket - length)

    def _check(self, call, padded_call, rows: int, length: int, bucket: int) -> bool:
        """Whether padding passed the shadow check on a copy (else the unit refused it)."""
        model = self._model
        try:
            self._checked = check.check(
                model, call, padded_call, rows, length, bucket, self.run.steps.unseen, self.run.backend.device_type
            )
        except check.CheckFailed as failed:
            self._refuse(failed.code, **failed.params)
            return False
        except Exception as error:  # the copy could not run: no proof, so no padding
            self._refuse("check_failed", error=f"{type(error).__name__}: {error}")
            return False
        difference = f"{self._checked:.2g}"
        self.report.because("bucketed", model=type(model).__name__, buckets=list(self._buckets), difference=difference)
        return True

    def changes(self) -> list:
        if self._dynamic:
            names = ", ".join(sorted(self._dynamic))
            return [f"{type(self._model).__name__}'s sequence dimension ({names}) marked dynamic for torch.compile"]
        if self._scope is None or self._checked is None or not self._positions:
            return []
        shapes = self._shapes()
        return [
            f"{type(self._model).__name__}'s sequence lengths padded up to {len(self._buckets)} bucket(s) "
            f"{list(self._buckets)}: {shapes['distinct_before']} batch shapes reached it as "
            f"{shapes['distinct_after']}, at {round(100 * shapes['padded_fraction'], 1)}% of positions padding"
        ]
