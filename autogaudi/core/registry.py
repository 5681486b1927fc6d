"""Every optimization unit autogaudi knows, as data, in the order they are applied.

The registry names each unit and says in one line what it does; the unit's module (imported only
once torch is imported) says what it patches, when it applies, and how it is undone. Keeping the
list here, free of torch imports, lets option validation and ``--help`` run before torch loads.
"""

from __future__ import annotations

ALL_BACKENDS = ("hpu", "cuda", "cpu")
# The unit that profiles the step, whose profile other units act on (session.profiler).
PROFILER = "step_profiler"

# The units that cannot act on every backend: where they can, and why not elsewhere (the report's
# words). Known here so the session never imports a unit where it cannot act: its module costs
# start-up, and may need that backend's libraries. A unit reads its own from here.
ACTS_ONLY_ON = {
    "gpu_migration": (("hpu",), "the toolkit maps CUDA calls onto a Gaudi only"),
    "hpu_mode": (("hpu",), "lazy and eager are Gaudi's execution modes"),
    "step_marks": (("hpu",), ""),
    "pipelining_fwd_bwd": (("hpu",), ""),
    "fused_clip_norm": (("hpu",), "torch's clip_grad_norm_ already runs its foreach kernels there"),
    "fused_sdpa": (("hpu",), "torch already dispatches this op to its fused kernels there"),
    "pin_memory": (("hpu", "cuda"), "pinning does nothing without a device to copy to"),
    "non_blocking_copy": (("hpu", "cuda"), "a CPU-only run makes no host-to-device copies"),
}


class UnitInfo:
    """A unit's name, one-line summary, ``"package.module:Class"``, whether it is opt-in (off
    unless named in ``--force``, for units with a cost the user must accept), and the backends it
    can act on (:data:`ACTS_ONLY_ON`). A plain class, not a NamedTuple: importing ``typing`` would
    cost every ``AUTOGAUDI=1`` process ~8 ms.

    ``waits_for``: the events (:class:`~autogaudi.core.events.Event` names) before which the unit does
    nothing; the session loads it at the first of them (:mod:`autogaudi.core.waiting`), its row saying
    ``waiting`` (a core reason code) until then, except on the backends in ``starts_at_once_on``.

    ``needs_budget``: the unit acts only on a step with a memory budget; where none can exist (the
    CPU without ``--memory-limit``) it is not imported, and its row reads ``not needed``."""

    __slots__ = (
        "name",
        "summary",
        "module",
        "opt_in",
        "switched_on_by",
        "backends",
        "why_not_elsewhere",
        "waits_for",
        "waiting",
        "starts_at_once_on",
        "needs_budget",
    )

    def __init__(
        self,
        name: str,
        summary: str,
        module: str,
        opt_in: bool = False,
        switched_on_by=None,
        waits_for: tuple = (),
        waiting: str = "",
        starts_at_once_on: tuple = (),
        needs_budget: bool = False,
    ):
        self.name = name
        self.summary = summary
        self.module = module
        self.opt_in = opt_in
        # (option, why it is off by default): a unit off while that option reads "off", and then not
        # even imported
        self.switched_on_by = switched_on_by
        self.backends, self.why_not_elsewhere = ACTS_ONLY_ON.get(name, (ALL_BACKENDS, ""))
        self.waits_for, self.waiting, self.starts_at_once_on = waits_for, waiting, starts_at_once_on
        self.needs_budget = needs_budget


UNITS: tuple[UnitInfo, ...] = (
    UnitInfo(
        "gpu_migration",
        "HPU: a script written for CUDA runs on Gaudi through Intel's GPU migration toolkit, switched on before "
        "the bridge loads",
        "autogaudi.optimizations.gpu_migration:GpuMigration",
    ),
    UnitInfo(
        "hpu_mode",
        "HPU: lazy or eager, measured once each where the script runs in both, the faster set before the bridge "
        "loads in later runs",
        "autogaudi.optimizations.hpu_mode.unit:HpuMode",
    ),
    UnitInfo(
        "step_marks",
        "HPU lazy mode: mark_step() after every backward and every optimizer step",
        "autogaudi.optimizations.step_marks:StepMarks",
    ),
    UnitInfo(
        "pipelining_fwd_bwd",
        "HPU lazy mode, opt-in: one more mark_step() before backward, overlapping graph build and run",
        "autogaudi.optimizations.pipelining_fwd_bwd:PipeliningFwdBwd",
        opt_in=True,
    ),
    UnitInfo(
        PROFILER,
        "classifies the run host-, device-, communication- or input-bound from a sampled window of steps, "
        "for the report and other units",
        "autogaudi.optimizations.step_profiler.unit:StepProfiler",
    ),
    UnitInfo(
        "fused_optimizer",
        "Adam/AdamW/SGD run as one fused kernel per step (HPU: hpex fused optimizers; else fused=True)",
        "autogaudi.optimizations.fused_optimizer.unit:FusedOptimizer",
    ),
    UnitInfo(
        "fused_clip_norm",
        "HPU: clip_grad_norm_ (L2) through hpex FusedClipNorm, built once per parameter set",
        "autogaudi.optimizations.fused_clip_norm:FusedClipNormUnit",
    ),
    UnitInfo(
        "fused_sdpa",
        "HPU: scaled_dot_product_attention through hpex FusedSDPA (also inside nn.MultiheadAttention)",
        "autogaudi.optimizations.fused_sdpa:FusedSdpa",
    ),
    UnitInfo(
        "mixed_precision",
        "opt-in with --precision: bf16 or fp16 (loss-scaled) autocast of the training model's forward, or CUDA "
        "TF32, used only after it matched float32 on the run's own steps, watched for NaN/Inf and loss spikes",
        "autogaudi.optimizations.mixed_precision.unit:MixedPrecision",
        switched_on_by=("precision", "it changes numerics"),
    ),
    UnitInfo(
        "activation_checkpointing",
        "where a step's peak, forecast on fake tensors before the first forward, exceeds --memory-limit or the "
        "device: activation checkpointing of the fewest repeated blocks that bring it under",
        "autogaudi.optimizations.activation_checkpointing:ActivationCheckpointing",
        needs_budget=True,
    ),
    UnitInfo(
        "graph_capture",
        "host-bound runs: the training model replays captured graphs (HPU graphs, CUDA graphs, torch.compile), "
        "if a trial finds it faster",
        "autogaudi.optimizations.graph_capture.unit:GraphCapture",
        waits_for=("STEP_PROFILED",),
        waiting="waiting_for_profile",
        starts_at_once_on=("hpu",),  # HPU lazy graphs refuse checkpointing: its calls are counted from the start
    ),
    UnitInfo(
        "shape_buckets",
        "where shapes matter (HPU, graph capture, torch.compile): variable sequence lengths padded up to a few "
        "buckets, only where the batch's mask makes the padding provably harmless (checked on a copy)",
        "autogaudi.optimizations.shape_buckets.unit:ShapeBuckets",
        waits_for=("BATCH_FETCHED", "STEP_PROFILED"),
        waiting="waiting_for_profile",
    ),
    UnitInfo(
        "channels_last",
        "convolutional models and their 4-D inputs in channels_last memory format, if a trial finds it faster",
        "autogaudi.optimizations.channels_last:ChannelsLast",
        waits_for=("STEP_PROFILED",),
        waiting="waiting_for_profile",
    ),
    UnitInfo(
        "loader_workers",
        "DataLoader worker processes for loaders measured to starve the step, from the batch after the measured ones",
        "autogaudi.optimizations.loader_workers.unit:LoaderWorkers",
        waits_for=("LOADER_BUILT", "EPOCH_START", "BEFORE_BATCH", "BATCH_FETCHED"),
        waiting="no_loader",
    ),
    UnitInfo(
        "pin_memory",
        "DataLoader(pin_memory=True) when batches are copied to an accelerator",
        "autogaudi.optimizations.pin_memory:PinMemory",
    ),
    UnitInfo(
        "static_last_batch",
        "where shapes matter (HPU lazy, graph capture, torch.compile): pad each epoch to whole batches so no "
        "short last batch triggers a recompile",
        "autogaudi.optimizations.static_last_batch:StaticLastBatch",
        waits_for=("LOADER_BUILT",),
        waiting="no_loader",
    ),
    UnitInfo(
        "ddp_tuning",
        "DistributedDataParallel with gradient_as_bucket_view, and buffers/bucket size set from the model",
        "autogaudi.optimizations.ddp_tuning:DdpTuning",
    ),
    UnitInfo(
        "fast_ddp",
        "opt-in: DistributedDataParallel gradients averaged by one flattened all-reduce after backward, "
        "not DDP's hooks",
        "autogaudi.optimizations.fast_ddp:FastDdp",
        opt_in=True,
    ),
    UnitInfo(
        "throughput_meter",
        "steps/s and samples/s after warm-up, memory, and a progress line every --log-every steps",
        "autogaudi.optimizations.throughput_meter:ThroughputMeter",
    ),
    UnitInfo(
        "non_blocking_copy",
        "host-to-accelerator copies of pinned tensors with non_blocking=True",
        "autogaudi.optimizations.non_blocking_copy:NonBlockingCopy",
    ),
)

UNIT_NAMES: tuple[str, ...] = tuple(unit.name for unit in UNITS)
OPT_IN_UNITS: tuple[str, ...] = tuple(unit.name for unit in UNITS if unit.opt_in)
SWITCHED_ON_BY: dict = {unit.name: unit.switched_on_by for unit in UNITS if unit.switched_on_by}
