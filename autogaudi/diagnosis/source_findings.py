"""The doctor's findings read from the script and its models rather than from the ops it ran: CUDA
calls (and what Intel's GPU migration toolkit does with each), optimizers with no Gaudi fused kernel,
hand-written attention, and what keeps a model out of an HPU graph.

Why apart: these judge code and objects (the script's lines, the optimizers that stepped, the
forward's source and signature), not the observed run's figures; the lists they judge by are the
ones the units act on (:mod:`autogaudi.optimizations.gpu_migration`'s support list,
:mod:`autogaudi.backends.hpu`'s fused-optimizer and graph checks), so the doctor and the units agree.
"""

from __future__ import annotations

import inspect
import os
import re

import torch

from autogaudi.backends import hpu
from autogaudi.diagnosis.finding import Finding
from autogaudi.entry import script_source
from autogaudi.optimizations import gpu_migration

# hpex.optimizers' fused kernels (hpu-api.md) for torch.optim classes the fused_optimizer unit does
# not swap: the script can use them itself.
HPEX_ONLY = {"Adagrad": "FusedAdagrad"}
# Hand-written attention in a forward's source: a softmax over a product with a transposed operand,
# and the product of the result; where the forward already calls SDPA, nothing to replace.
_SOFTMAX = re.compile(r"\bsoftmax\(")
_PRODUCT = re.compile(r"@|\bmatmul\(|\bbmm\(|\beinsum\(")
_TRANSPOSED = re.compile(r"\.transpose\(|\.mT\b|\.T\b|\.permute\(|\beinsum\(")
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_CUDA_CALL = re.compile(r"torch\.cuda\.[\w.]+")
_SDPA = re.compile(r"scaled_dot_product_attention|FusedSDPA")


def _cuda_uses(number: int, code: str) -> list:
    """Each CUDA use on a line of the script (``torch.cuda.synchronize``, ``.cuda()``, ``"cuda"``),
    with what the toolkit runs it as."""
    uses = []
    for match in script_source.CUDA_USE.finditer(code):
        called = _CUDA_CALL.match(code, match.start()) if match.group().startswith("torch.cuda.") else None
        kind = "torch.cuda" if called else "cuda device"
        uses.append(
            {"line": number, "use": called.group() if called else match.group(), "toolkit": gpu_migration.MAPPED[kind]}
        )
    return uses


def cuda_calls(observer) -> list:
    """Each line of the script that uses CUDA, with what the toolkit maps it to, and each CUDA-bound
    library it imports, which the toolkit cannot map."""
    if observer.script is None:
        return []
    found = script_source.read_script(observer.script)
    try:
        with open(observer.script, encoding="utf-8", errors="replace") as handle:
            source = handle.readlines()
    except OSError:  # the script removed itself: nothing to read
        source = []
    calls = [use for number, line in enumerate(source, 1) for use in _cuda_uses(number, line.split("#", 1)[0])]
    findings = []
    if calls:
        findings.append(
            Finding(
                "cuda_call",
                "low",
                f"{len(calls)} CUDA use(s) in the script; Intel's GPU migration toolkit maps each onto hpu",
                (observer.script, calls[0]["line"]),
                {"calls": calls[:20], "variable": f"{gpu_migration.VARIABLE}=1"},
                "on a Gaudi without the toolkit the script takes its CPU path (torch.cuda.is_available() is "
                "False); the toolkit maps torch.cuda calls and 'cuda' devices onto hpu, and optimizes nothing",
                f"run with {gpu_migration.VARIABLE}=1 (autogaudi sets it for a script that uses CUDA), or write "
                'device = "hpu" and torch.hpu calls',
                fixed_by="gpu_migration",
                score=len(calls),
            )
        )
    for library, where in found["not_mapped"].items():
        line = int(where.rsplit(":", 1)[1]) if where.startswith(_own_name(observer.script) + ":") else None
        findings.append(
            Finding(
                "cuda_call",
                "high",
                f"{library} ({script_source.NOT_MAPPED[library]}) is CUDA-bound: the toolkit cannot map it",
                (observer.script, line) if line else None,
                {"library": library, "imported_at": where},
                "Intel's GPU migration toolkit maps torch.cuda, 'cuda' devices, Apex and pynvml; a library "
                "with CUDA kernels of its own does not run on a Gaudi",
                "use the torch op it stands for (attention: torch.nn.functional.scaled_dot_product_attention, "
                "which runs as hpex FusedSDPA on Gaudi) or the library's Gaudi port",
                score=1,
            )
        )
    return findings


def _own_name(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]


def unfused_optimizers(observer) -> list:
    findings = []
    for optimizer in observer.optimizers.values():
        name = type(optimizer).__name__
        refusal = hpu.fused_optimizer_refusal(name, optimizer.defaults)
        if refusal is None:
            continue
        own = HPEX_ONLY.get(name)
        fix = (
            f"hpex.optimizers.{own} (habana_frameworks.torch.hpex.optimizers) with the same values"
            if own
            else "AdamW (FusedAdamW) or SGD (FusedSGD) without the arguments named, if the experiment allows"
        )
        findings.append(
            Finding(
                "unfused_optimizer",
                "medium",
                f"{name}: {refusal}",
                _step_location(type(optimizer)),
                {"optimizer": name, "parameters": sum(len(group["params"]) for group in optimizer.param_groups)},
                "without a fused kernel each parameter's update is several small ops every step; hpex has "
                "FusedAdamW, FusedSGD, FusedAdagrad, FusedLamb and FusedLars",
                fix,
                fixed_by=None if own else "fused_optimizer (for AdamW, SGD and Adam without L2 decay)",
                score=1,
            )
        )
    return findings


def _step_location(cls):
    """(file, line) of the ``step`` of an optimizer class of the script's own, or None (torch's)."""
    code = getattr(cls.step, "__code__", None)
    if code is None or code.co_filename.startswith(_TORCH_DIR):
        return None
    return code.co_filename, code.co_firstlineno


def _forward_source(cls):
    """(file, first line, source lines) of ``cls.forward``, or None where it has no source."""
    try:
        lines, first = inspect.getsourcelines(cls.forward)
        return inspect.getsourcefile(cls.forward), first, lines
    except (OSError, TypeError):
        return None


def manual_attention(observer) -> list:
    findings = []
    seen = set()
    for model in observer.models.values():
        for module in model.modules():
            cls = type(module)
            if cls in seen or cls.__module__.startswith("torch."):
                continue
            seen.add(cls)
            found = _forward_source(cls)
            if found is None:
                continue
            file, first, lines = found
            code = "".join(line.split("#", 1)[0] for line in lines)
            if _SDPA.search(code) or not (_PRODUCT.search(code) and _TRANSPOSED.search(code)):
                continue
            softmax = next((n for n, line in enumerate(lines) if _SOFTMAX.search(line.split("#", 1)[0])), None)
            if softmax is None:
                continue
            findings.append(
                Finding(
                    "manual_attention",
                    "medium",
                    f"{cls.__name__}.forward computes attention by hand (softmax of q @ k^T, times v)",
                    (file, first + softmax),
                    {"module": cls.__name__},
                    "the scores matrix (sequence x sequence) is written out and read back; Gaudi's FusedSDPA "
                    "computes attention in one kernel, with less memory and optional recompute",
                    "torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=...): on "
                    "Gaudi autogaudi runs it as hpex FusedSDPA",
                    fixed_by="fused_sdpa (once the forward calls scaled_dot_product_attention)",
                    score=1,
                )
            )
    return findings


def graph_blockers(observer) -> list:
    """Models ModuleCacher cannot capture: a forward taking ``*args`` (or positional-only
    parameters), or module hooks, which a replay would not run (the backend's own check)."""
    findings = []
    for model in observer.models.values():
        blocked = hpu.graph_blocker(model)
        if blocked is None:
            continue
        code, params = blocked
        positional = code == "positional_forward"
        location = _forward_source(type(model))  # a class's own source is gone with the script's __main__
        findings.append(
            Finding(
                "graph_blocker",
                "high",
                f"{type(model).__name__}: "
                + ("its forward takes *args or positional-only arguments" if positional else "module hooks")
                + " keep it out of HPU graphs",
                location[:2] if location else None,
                {"blocker": code, **params},
                "ModuleCacher calls the model by keyword (it asserts on *args) and replays the recorded graph "
                "without Python, so module hooks would silently stop running",
                "name the forward's parameters"
                if positional
                else "remove the hooks from the training model, or move what they do into forward",
                score=1,
            )
        )
    return findings


RULES = (cuda_calls, unfused_optimizers, manual_attention, graph_blockers)
