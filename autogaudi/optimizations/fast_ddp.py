"""fast_ddp (opt-in): a DistributedDataParallel model's gradients averaged by one flattened
all-reduce after backward, instead of DDP's per-parameter autograd hooks and bucketed all-reduces.

Why: optimum-habana's "fast_ddp" strategy. On Gaudi, DDP's reducer does host work per parameter and
per bucket while the backward graph is built; one collective over one buffer after backward is
cheaper there. It gives up overlapping communication with the backward, so it is opt-in and measured.

The DDP object stays what the script built: its forward runs with the reducer idle (the switch
``no_sync()`` uses) and, where the script asked for a synchronised backward, the gradients are
averaged as DDP averages them when that backward returns. Every rank hands the model back to DDP at
the same step when the set of parameters with gradients changes: a rank-dependent decision would
hang the next collective. The rounding against DDP's own buckets is measured once, on copies
(:func:`bucketed_average`). docs/units/fast_ddp.md has the details.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from autogaudi.core.events import Event
from autogaudi.core.unit import ROUNDING, Unit, UnitSpec
from autogaudi.measure import numerics


def why_ddp_keeps(model) -> str | None:
    """Why this DDP model's gradient sync must stay DDP's own, or None when fast_ddp can take it."""
    if type(model) is not DistributedDataParallel:
        return f"{type(model).__name__} subclasses DistributedDataParallel"
    # getattr: the private flags came with different torch versions; absent means not in use.
    settings = {
        "static_graph": model.static_graph,
        "a communication hook": getattr(model, "_comm_hooks", ()),
        "mixed_precision": getattr(model, "mixed_precision", None) is not None,
        "compiled DDP (python reducer)": getattr(model, "_use_python_reducer", False),
        "delayed all-reduce of all parameters": getattr(model, "_delay_all_reduce_all_params", False),
    }
    custom = [name for name, used in settings.items() if used]
    if custom:
        return f"the script set {', '.join(custom)}"
    params = [p for p in model.module.parameters() if p.requires_grad]
    if len({(p.dtype, p.device) for p in params}) > 1:
        return "its parameters have several dtypes or devices"
    return None


def read_counts(counts) -> tuple:
    """The reduced per-parameter rank counts, read to the host as whole numbers (a device sync)."""
    return tuple(int(count) for count in counts.tolist())


def ddp_buckets(model, params) -> list:
    """The parameter indices of each bucket DDP's reducer all-reduces after its first step, with its
    bucket caps. Without ``find_unused_parameters`` the reducer rebuilds its buckets in the order the
    gradients became ready; that order is taken to be the parameters' reverse one (the assumption DDP's
    own first assignment makes). With it, the first assignment stays: parameter order."""
    config = getattr(model, "_bucket_config", None)
    if config is not None and hasattr(config, "compute_bucket_size_limits"):
        limits = config.compute_bucket_size_limits(static_graph=False, find_unused_parameters=True)[0]
    else:  # torch before the bucket config: a first bucket of its own size, then the cap
        limits = [dist._DEFAULT_FIRST_BUCKET_BYTES, model.bucket_bytes_cap]
    if model.find_unused_parameters:
        return dist._compute_bucket_assignment_by_size(params, limits)[0]
    order = list(reversed(range(len(params))))
    return dist._compute_bucket_assignment_by_size([params[i] for i in order], limits, [False] * len(order), order)[0]


def bucketed_average(pieces, buckets, world: int, group) -> list:
    """Copies of the flattened gradients ``pieces`` averaged as DDP's reducer averages them: each
    multiplied by 1/world into its bucket's buffer, each bucket all-reduced on its own; by index."""
    averaged = [None] * len(pieces)
    for bucket in buckets:
        buffer = torch.cat([pieces[i] for i in bucket]).mul_(1.0 / world)
        dist.all_reduce(buffer, group=group)
        for index, value in zip(bucket, buffer.split([pieces[i].numel() for i in bucket])):
            averaged[index] = value
    return averaged


def every_rank(flag: bool, group, device) -> bool:
    """Whether ``flag`` holds on every rank of ``group`` (one all-reduce of one number): a decision
    all ranks take alike, so that none waits in a collective the others skip."""
    votes = torch.tensor([float(flag)], device=device)
    dist.all_reduce(votes, group=group)
    return int(votes.item()) == dist.get_world_size(group)


class FlatAllReduce:
    """The per-model state: which parameters, the first step's counts, the counts still to check."""

    def __init__(self, model):
        self.params = [p for p in model.module.parameters() if p.requires_grad]
        self.buckets = ddp_buckets(model, self.params)
        self.sizes = [p.numel() for p in self.params]
        self.numel = sum(self.sizes)
        self.group = model.process_group
        self.world = dist.get_world_size(self.group)
        self.first_counts = None  # ranks with a gradient, per parameter, in the first averaged step
        self.unchecked_counts = None  # the latest step's counts, a tensor, read at the next step
        self.armed = False  # the model ran a forward whose backward is to be averaged
        self.handed_back = False  # DDP's reducer took over again (the reason says why)

    def changed_counts(self):
        """The previous step's counts when they differ from the first step's, else None."""
        if self.unchecked_counts is None:
            return None
        counts = read_counts(self.unchecked_counts)
        self.unchecked_counts = None
        return counts if counts != self.first_counts else None

    def pieces(self) -> list:
        """Each parameter's gradient flattened (a view), zeros where this rank has none."""
        return [(p.grad if p.grad is not None else p.new_zeros(p.shape)).reshape(-1) for p in self.params]

    def average(self) -> None:
        """One all-reduce of every gradient and of the per-parameter counts, then copy back."""
        self.armed = False
        anchor = self.params[0]
        grads = [p.grad for p in self.params]
        pieces = self.pieces()
        present = torch.tensor([g is not None for g in grads], dtype=anchor.dtype, device=anchor.device)
        buffer = torch.cat([*pieces, present])
        buffer[: self.numel].div_(self.world)
        dist.all_reduce(buffer, group=self.group)
        counts = buffer[self.numel :]
        if self.first_counts is None:
            self.first_counts = read_counts(counts)  # in the first step only
        else:
            self.unchecked_counts = counts
        averaged = buffer[: self.numel].split(self.sizes)
        # Where this rank has no gradient, whether another rank had one decides between the average
        # and None: only then are this step's counts read at once (a sync, for models with unused
        # parameters only).
        needed = self.first_counts if all(g is not None for g in grads) else read_counts(counts)
        for p, g, value, count in zip(self.params, grads, averaged, needed):
            if g is not None:
                g.copy_(value.view_as(g))
            elif count:  # another rank had a gradient for it: DDP gives every rank the average
                p.grad = value.view_as(p).clone()


class FastDdp(Unit):
    spec = UnitSpec(
        # One flat buffer: each gradient lands elsewhere in the all-reduce's chunks, so ranks' values can
        # be summed in another order (measured at the first averaged step)
        numerics=(ROUNDING,),
        exact_when="there are two ranks",
        reasons={
            "flat_all_reduce": "one flattened all-reduce of the gradients after each synchronised backward",
            "gradients_changed": "handed back to DDP's reducer: the set of parameters with gradients changed (ranks "
            "per parameter {first} at first, then {then})",
            "ddp_keeps_sync": "DDP kept its own gradient sync: {why}",
            # note: the rounding against DDP's buckets was not measured (the report says "not measured")
            "rounding_not_measured_memory": "rounding not measured: a copy of the gradients ({gb:.2f} GB) would take "
            "more than {share:.0%} of the memory free on some rank",
        },
        changed_figure=("models", "{} DDP model(s) averaging gradients in one flat all-reduce"),
        targets=("torch.nn.parallel.DistributedDataParallel.forward",),
        acts_on=("after each backward pass (the session's step watcher)",),
    )

    def apply(self) -> None:
        self._models = weakref.WeakKeyDictionary()  # DDP model -> FlatAllReduce, or None where DDP keeps it
        self.report.figures.update(models=0, flat_all_reduces=0)
        self._measured_steps, self._largest_rounding = 0, 0.0
        self.scope.wrap(DistributedDataParallel, "forward", self._forward)
        self.scope.on(Event.AFTER_BACKWARD, self._after_backward)
        self.report.because("flat_all_reduce")

    def _flat_all_reduce(self, model):
        if model not in self._models:
            why = why_ddp_keeps(model)
            if why:
                self.report.note("ddp_keeps_sync", why=why)
                self._models[model] = None
            else:
                self._models[model] = FlatAllReduce(model)
                self.report.figures["models"] += 1
        state = self._models[model]
        return None if state is None or state.handed_back else state

    def _forward(self, wrapped, instance, args, kwargs):
        state = self._flat_all_reduce(instance)
        if state is None or instance._join_config.enable:  # uneven inputs: Join needs DDP's reducer
            return wrapped(*args, **kwargs)
        wanted = instance.require_backward_grad_sync
        instance.require_backward_grad_sync = False
        try:
            output = wrapped(*args, **kwargs)
        finally:
            instance.require_backward_grad_sync = wanted
        if wanted and torch.is_grad_enabled():
            instance.require_forward_param_sync = True  # DDP broadcasts buffers before the next forward
            state.armed = True
        return output

    def _after_backward(self) -> None:
        for state in list(self._models.values()):
            if state is None or not state.armed:
                continue
            changed = state.changed_counts()
            reference = self._ddp_reference(state) if state.first_counts is None else None
            state.average()
            self.report.figures["flat_all_reduces"] += 1
            if reference is not None:
                self._rounding_measured(state, reference)
            if changed:
                state.handed_back = True
                self.report.because("gradients_changed", first=list(state.first_counts), then=list(changed))

    # How far the flat average is from DDP's own, at each model's first averaged step --------------

    def _ddp_reference(self, state):
        """DDP's average of copies of this step's gradients, or None where a copy would not fit on
        some rank (decided with every rank, at a step every rank is at)."""
        size = state.numel * state.params[0].element_size()
        device = state.params[0].device
        if not every_rank(numerics.bytes_fit(size, device, self.run.backend), state.group, device):
            self.report.note("rounding_not_measured_memory", gb=size / 1024**3, share=numerics.FREE_SHARE)
            return None
        with torch.no_grad():
            return bucketed_average(state.pieces(), state.buckets, state.world, state.group)

    def _rounding_measured(self, state, reference) -> None:
        """The gradients the flat all-reduce just wrote against DDP's average (parameters no rank has
        a gradient for stay None with both)."""
        pairs = [(p.grad, value.view_as(p)) for p, value in zip(state.params, reference) if p.grad is not None]
        difference = numerics.largest_relative_difference(*zip(*pairs)) if pairs else 0.0
        self._measured_steps += 1
        self._largest_rounding = max(self._largest_rounding, difference)
        self.report.figures["numerics_measured"] = numerics.measured(
            self._largest_rounding,
            of="averaged gradients",
            steps=self._measured_steps,
            against="DDP's bucketed all-reduce of copies of the same gradients",
        )
