"""From what the observer saw to ranked findings: each with a place, evidence, the rule and the fix.

Every rule is one function ``rule(observer) -> [Finding]`` in ``RULES``. Severity says how much
the pattern costs on Gaudi (high: every step pays it; medium: some steps or some compilations;
low: efficiency left on the table); within a severity, findings with the larger figure come first.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import torch

from autogaudi.diagnosis import gaudi_facts as facts
from autogaudi.diagnosis import memory_fit, source_findings
from autogaudi.diagnosis.finding import SEVERITIES, Finding
from autogaudi.measure import step_memory

SCHEMA = "autogaudi.doctor/1"
KINDS = (
    "host_sync",
    "graph_blocker",
    "dynamic_ops",
    "dynamic_shapes",
    "python_scalar",
    "last_batch",
    "cpu_fallback",
    "input_bound",
    "tile_size",
    "mixed_precision",
    "memory",
    "cuda_call",
    "unfused_optimizer",
    "manual_attention",
)
_READS = {
    "item": "`.item()`",
    "condition": "a tensor used as a Python condition",
    "scalar": "a tensor converted to a Python number",
    "tolist": "`.tolist()`",
    "cpu": "`.cpu()`",
    "numpy": "`.numpy()`",
    "print": "printing a tensor",
}


def _per_step(observer, counts_by_step: Counter) -> float:
    steps = observer.measured_steps
    return sum(counts_by_step[step] for step in steps) / len(steps) if len(steps) else 0.0


def host_reads(observer) -> list:
    """Reads of device values outside the forward, per step: each one a host-device sync."""
    grouped = defaultdict(Counter)
    inside = defaultdict(Counter)
    for (step, kind, location, in_forward), count in observer.reads.items():
        (inside if in_forward else grouped)[(kind, location)][step] += count
    findings = []
    for (kind, location), by_step in grouped.items():
        rate = _per_step(observer, by_step)
        if rate == 0:
            continue  # set-up code before the loop: paid once
        findings.append(
            Finding(
                "host_sync",
                "high" if rate >= 1 else "medium",
                f"{_READS[kind]} reads a device value {rate:g}x per step",
                location,
                {"reads_per_step": rate, "read": kind, "steps_measured": len(observer.measured_steps)},
                "the host waits until the device has computed the value, and in lazy mode the graph is cut "
                "there, so the host cannot run ahead of the device (Gaudi guide: no .item(), printing or "
                ".cpu() of device tensors inside the training loop)",
                "keep the value on the device (e.g. accumulate the loss in a tensor) and read it every N "
                "steps or after the loop; for progress use autogaudi's --log-every N",
                score=rate,
            )
        )
    for (kind, location), by_step in inside.items():
        rate = _per_step(observer, by_step) or sum(by_step.values())
        findings.append(
            Finding(
                "graph_blocker",
                "high",
                f"data-dependent control flow in forward: {_READS[kind]}",
                location,
                {"reads_per_step": rate, "read": kind, "blocker": "host_read"},
                "a graph (HPU graphs, torch.compile) is captured once and replayed; a Python decision on a "
                "device value inside forward cannot be captured: ModuleCacher requires no data-dependent "
                "control flow, torch.compile breaks the graph there",
                "compute both branches and select with torch.where or a mask, or move the decision out of forward",
                score=rate,
            )
        )
    return findings


def dynamic_ops(observer) -> list:
    counts = defaultdict(Counter)
    for (step, op, location), count in observer.dynamic_ops.items():
        counts[(op, location)][step] += count
    return [
        Finding(
            "dynamic_ops",
            "medium",
            f"`{op}` in forward: its output shape depends on the data",
            location,
            {"op": op, "calls_per_step": _per_step(observer, by_step) or sum(by_step.values())},
            f"every new output shape is a new graph to compile on HPU ({facts.SOURCES['dynamic_shapes']})",
            "keep shapes static: a mask with torch.where instead of boolean indexing, fixed-size outputs "
            "(e.g. nonzero_static, padding to a maximum)",
            score=sum(by_step.values()),
        )
        for (op, location), by_step in counts.items()
    ]


def short_last_batches(observer) -> list:
    """(where the loader was built, batch size, dataset length, last batch size) for every loader
    whose epoch ends in a short batch."""
    return [
        (location, batch, length, length % batch)
        for location, batch, length, drop_last in observer.loaders
        if batch and length and not drop_last and length % batch
    ]


def _model_name(observer, label: str) -> str:
    return type(observer.models[label]).__name__


def dynamic_shapes(observer) -> list:
    """Models called with several input shapes; a short last batch alone is left to ``last_batch``."""
    findings = []
    short = {size for *_, size in short_last_batches(observer)}
    for label, shapes in observer.shapes.items():
        if len([key for key in shapes if not (key and all(shape and shape[0] in short for shape in key))]) < 2:
            continue
        seen = [{"shapes": [list(shape) for shape in key], "calls": count} for key, count in shapes.most_common()]
        findings.append(
            Finding(
                "dynamic_shapes",
                "high" if len(shapes) > 2 else "medium",
                f"{_model_name(observer, label)} was called with {len(shapes)} different input shapes",
                observer.call_sites.get(label),
                {
                    "module": _model_name(observer, label),
                    "distinct_shapes": len(shapes),
                    "shapes_seen": seen[:8],
                    "predicted_recompilations_per_epoch": f">= {len(shapes)} (one graph per input shape)",
                },
                "each new input shape is a graph recompilation on HPU (lazy mode and HPU graphs cache one "
                "graph per shape)",
                "pad inputs to a few fixed sizes (bucket sequence lengths), keep the batch size fixed",
                score=len(shapes),
            )
        )
    return findings


def python_scalars(observer) -> list:
    """Python numbers passed to a model whose value changes from call to call: each value is a
    constant of the graph, so each new one is a new graph to compile (Gaudi guide: avoiding
    constant variables in loops)."""
    findings = []
    for (label, argument), values in observer.scalars.items():
        if len(values) < 2:
            continue
        kind = type(next(iter(values))).__name__
        findings.append(
            Finding(
                "python_scalar",
                "high" if len(values) > 2 else "medium",
                f"{_model_name(observer, label)} is passed a Python {kind} as {argument} that took "
                f"{len(values)} values in {sum(values.values())} calls",
                observer.scalar_sites.get((label, argument)),
                {
                    "module": _model_name(observer, label),
                    "argument": argument,
                    "type": kind,
                    "distinct_values": len(values),
                    "values_seen": list(values)[:8],
                    "predicted_recompilations": f">= {len(values)} (one graph per value)",
                },
                "a Python number is a constant of the graph: each new value is a new graph to compile in lazy "
                "mode, a new HPU graph for ModuleCacher (it keys graphs by plain values) and a recompilation "
                f"for torch.compile ({facts.SOURCES['performance_guide']}: avoiding constant variables in loops)",
                "pass it as a tensor on the device (e.g. torch.tensor(value, device=...), or a device tensor "
                "rolled each step instead of indexing with the loop variable), or make it constant",
                score=len(values),
            )
        )
    return findings


def last_batch(observer) -> list:
    return [
        Finding(
            "last_batch",
            "medium",
            f"the last batch of each epoch has {size} samples instead of {batch_size}",
            location,
            {
                "dataset_length": length,
                "batch_size": batch_size,
                "last_batch_size": size,
                "predicted_recompilations_per_epoch": 1,
            },
            "the short last batch is a new input shape: one more graph compilation (and on HPU graphs "
            "one more cached graph) per loader",
            "drop_last=True, or pad the epoch to whole batches",
            fixed_by="static_last_batch",
            score=1,
        )
        for location, batch_size, length, size in short_last_batches(observer)
    ]


def cpu_fallback(observer) -> list:
    counts = Counter()
    ops = defaultdict(set)
    for (dtype, op, location), count in observer.dtype_ops.items():
        counts[(dtype, location)] += count
        ops[(dtype, location)].add(op)
    return [
        Finding(
            "cpu_fallback",
            "high",
            f"{dtype} tensors: Gaudi has no {dtype} support",
            location,
            {
                "dtype": dtype,
                "op_calls": count,
                "ops": sorted(ops[(dtype, location)])[:10],
                "facts": f"{facts.SOURCES['support_matrix']} (retrieved {facts.RETRIEVED})",
            },
            "the Support Matrix lists float64 and complex types as unsupported: such ops fall back to the "
            "CPU (a host round trip each) or fail",
            "use float32 (e.g. torch.from_numpy(array).float(), dtype=torch.float32)",
            score=count,
        )
        for (dtype, location), count in counts.items()
    ]


def input_bound(observer) -> list:
    step = observer.step_seconds()
    if not step or not observer.loaders:
        return []
    waited = sum(observer.waited[index] for index in observer.measured_steps) / len(observer.measured_steps)
    fraction = waited / step
    if fraction < 0.1:
        return []
    return [
        Finding(
            "input_bound",
            "high" if fraction >= 0.5 else "medium" if fraction >= 0.2 else "low",
            f"the step waits for the DataLoader {fraction:.0%} of the time",
            observer.loaders[0][0],
            {
                "input_wait_fraction": round(fraction, 3),
                "step_ms": round(step * 1000, 2),
                "wait_ms_per_step": round(waited * 1000, 2),
            },
            "while the host prepares batches the device idles; a faster device only makes it worse",
            "DataLoader(num_workers=..., pin_memory=True, persistent_workers=True)",
            fixed_by="loader_workers, pin_memory",
            score=fraction,
        )
    ]


def tile_sizes(observer) -> list:
    findings = []
    batch_sizes = sorted({batch for _, batch, _, _ in observer.loaders if batch})
    odd = [batch for batch in batch_sizes if batch % facts.BATCH_MULTIPLE]
    if odd:
        findings.append(
            Finding(
                "tile_size",
                "low",
                f"batch size {odd[0]} is not a multiple of {facts.BATCH_MULTIPLE}",
                None,
                {"batch_sizes": batch_sizes},
                "the matrix engine works on fixed tiles; a remainder leaves part of a tile idle",
                f"a batch size that is a multiple of {facts.BATCH_MULTIPLE}",
                score=1,
            )
        )
    layers = []
    for label, model in observer.models.items():
        for name, module in model.named_modules():
            dims = _matrix_dimensions(module)
            if any(dim >= facts.LARGE_DIMENSION and dim % facts.MATRIX_MULTIPLE for dim in dims):
                layers.append(f"{name or _model_name(observer, label)} {type(module).__name__}{tuple(dims)}")
    if layers:
        findings.append(
            Finding(
                "tile_size",
                "low",
                f"{len(layers)} large layer(s) with a dimension not a multiple of {facts.MATRIX_MULTIPLE}",
                None,
                {"layers": layers[:10]},
                f"large matrices (>= {facts.LARGE_DIMENSION}) fill the matrix engine best in multiples of "
                f"{facts.MATRIX_MULTIPLE} in bf16",
                f"round hidden sizes to a multiple of {facts.MATRIX_MULTIPLE}",
                score=len(layers),
            )
        )
    return findings


def _matrix_dimensions(module) -> list:
    if isinstance(module, torch.nn.Linear):
        return [module.in_features, module.out_features]
    if isinstance(module, torch.nn.modules.conv._ConvNd):
        return [module.in_channels, module.out_channels]
    return []


def mixed_precision(observer) -> list:
    total = sum(observer.forward_op_seconds.values())
    if observer.autocast_seen or not total:
        return []
    shares = Counter()
    for op, seconds in observer.forward_op_seconds.items():
        name = facts.ATEN_ALIASES.get(op, op)
        shares[
            "bf16" if name in facts.AUTOCAST_BF16_OPS else "fp32" if name in facts.AUTOCAST_FP32_OPS else "other"
        ] += seconds
    bf16 = shares["bf16"] / total
    if bf16 < 0.3:
        return []
    top = [
        op
        for op, _ in observer.forward_op_seconds.most_common()
        if facts.ATEN_ALIASES.get(op, op) in facts.AUTOCAST_BF16_OPS
    ][:6]
    fp32 = sorted(op for op in observer.forward_op_seconds if facts.ATEN_ALIASES.get(op, op) in facts.AUTOCAST_FP32_OPS)
    return [
        Finding(
            "mixed_precision",
            "low",
            f"bf16-ready: {bf16:.0%} of forward time is in ops Gaudi autocast runs in bf16",
            None,
            {
                "bf16_share": round(bf16, 3),
                "fp32_share": round(shares["fp32"] / total, 3),
                "bf16_ops": top,
                "fp32_ops": fp32,
                "facts": f"{facts.SOURCES['autocast']} (retrieved {facts.RETRIEVED})",
            },
            "the script trains in float32; Gaudi's autocast runs these ops in bfloat16 on the matrix engine "
            "and keeps the listed fp32 ops in float32",
            'wrap forward and loss in torch.autocast(device_type="hpu", dtype=torch.bfloat16); check the loss curve',
            score=bf16,
        )
    ]


def memory_projection(observer):
    """The projection of the largest training model's step (:mod:`autogaudi.diagnosis.memory_fit`),
    made once per observer; None where no training call was seen or its step cannot be forecast."""
    if not hasattr(observer, "memory_projection"):
        observer.memory_projection = None
        models = [(label, observer.models[label]) for label in observer.training_inputs if label in observer.models]
        if models:
            label, model = max(models, key=lambda item: sum(p.numel() for p in item[1].parameters()))
            try:
                observer.memory_projection = memory_fit.projection(
                    model, observer.training_inputs[label], observer.optimizers.values()
                )
            except Exception:  # noqa: BLE001 - a forward fake tensors cannot run: no projection, no finding
                observer.memory_projection = None
    return observer.memory_projection


def memory(observer) -> list:
    found = memory_projection(observer)
    if found is None:
        return []
    batch = found["batch"]
    short = {
        name: row
        for name, row in found["devices"].items()
        if row["largest_batch"] is not None and row["largest_batch"] < batch
    }
    if not short:
        return []
    name, row = min(short.items(), key=lambda item: item[1]["capacity_bytes"])
    checkpointed = row.get("largest_batch_checkpointed")
    levers = []
    if checkpointed is not None and checkpointed >= batch:
        levers.append(f"checkpoint the {found['blocks']} repeated blocks: batch up to {checkpointed} fits")
    elif row["largest_batch"]:
        micro = row["largest_batch"] if checkpointed is None else max(row["largest_batch"], checkpointed)
        levers.append(
            f"a micro-batch of {micro} with {-(-batch // micro)} gradient accumulation steps (or a smaller batch)"
        )
    if found["eight_bit_optimizer_saves_bytes"]:
        levers.append(
            f"an 8-bit or factored optimizer instead of {found['optimizer']}: "
            f"{found['eight_bit_optimizer_saves_bytes'] / 1e6:.1f} MB less optimizer state"
        )
    return [
        Finding(
            "memory",
            "high",
            f"the step's projected peak {found['peak_bytes'] / 1e9:.2f} GB at batch {batch} does not fit "
            f"{', '.join(short)}",
            None,
            {
                "peak_bytes": found["peak_bytes"],
                "per_sample_bytes": found["per_sample_bytes"],
                **{f"largest_batch_{device}": r["largest_batch"] for device, r in found["devices"].items()},
            },
            f"{name} holds {row['capacity_bytes'] / 1e9:.0f} GB, of which a step can plan on "
            f"{step_memory.CAPACITY_SHARE:.0%}; parameters, gradients and optimizer state are fixed, "
            f"activations grow with the batch",
            "; or ".join(levers) or "a smaller model or a device with more memory",
            fixed_by="activation_checkpointing" if checkpointed is not None and checkpointed >= batch else None,
            score=found["peak_bytes"],
        )
    ]


RULES = (
    host_reads,
    dynamic_ops,
    dynamic_shapes,
    python_scalars,
    last_batch,
    cpu_fallback,
    input_bound,
    tile_sizes,
    mixed_precision,
    memory,
    *source_findings.RULES,
)


def judge(observer) -> list:
    findings = [finding for rule in RULES for finding in rule(observer)]
    return sorted(findings, key=lambda f: (SEVERITIES.index(f.severity), -f.score))
