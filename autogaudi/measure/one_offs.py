"""What a capture will cost once, predicted before paying it, and learned from what it cost here.

Why: the pay-back rule used to wait for the *least* one-off ever measured on the backend (2 s on
the CPU), while a model's compile grows with its graph (2 s for one ``Linear``, 20 s for a small
GPT on the 2-core CPU): a run could start a trial expecting 2 s and pay 10. The estimate is a size
of the model's graph times a rate of this machine:

- *size*: the square root of the ops a training step issues (the step profile's census); the
  one-offs measured on the 2-core CPU grew about so (30 ops 3.4 s, 650 ops 21 s, 1254 ops 16 s);
  for regional compilation (one block compiled and reused for its repeats), the ops outside the
  blocks plus one block's share;
- *rate*: seconds per unit of size, learned from the one-offs measured on this machine (backend,
  device, torch) and kept in the cache, pulled towards the backend's prior (a pseudo-observation
  of weight ``PRIOR_WEIGHT``) so that one odd run moves it only part of the way; each measurement
  is divided by the load it ran under, and an estimate multiplied by the load now
  (:mod:`autogaudi.measure.machine_load`): a busy machine compiles slower. A warm compile
  cache has a rate of its own (a second run compiled for 0.10-0.17x of the first's one-off).

The uncertainty is the geometric spread of the measured ratios (the prior's ``PRIOR_SPREAD`` until
measurements say otherwise): the estimate is a central figure and ``low``-``high`` its range.
Three tiers: the whole model compiled, its repeated blocks compiled (``regional``), or, where the
backend has it, the model's calls replayed as device graphs without a compiler's code generation
(``replay``: CUDA graphs, a trace's one-off instead of inductor's, with a rate of its own).
:func:`choose` picks the tier by the estimates. The compile itself is
kept for the next run too: ``torch.compiler.save_cache_artifacts`` per script, keyed so that a
changed script, model, inputs, torch or device misses and says which (:func:`load_artifacts`).
Measurements and their stories: docs/units/graph_capture.md.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from autogaudi.measure import machine_load
from autogaudi.store.cache import COMPILE, ONE_OFFS, SCHEMAS, distrust, now, problem, read_bytes, read_json, sha256
from autogaudi.store.decisions import digest, model_structure, script_identity

ARTIFACTS = (COMPILE, "artifacts")
KEPT = 40  # records kept per machine: the newest
PRIOR_WEIGHT = 2.0  # the prior counts as this many measurements
PRIOR_SPREAD = 2.0  # the prior's factor of uncertainty either way
WARM_FACTOR = 0.2  # a warm compile cache's one-off against a cold one's, before any is measured
REGIONAL_KEEPS = 0.7  # the share of a whole capture's saving per step a regional one keeps (measured, CPU)
REGIONAL_SHARE = 0.5  # the least share of the parameters repeated blocks hold to be compiled by region
# The share of a whole capture's saving per step that graphs replayed without a compiler keep (launches
# cut, no kernels fused): on an H100 a host-bound 4-layer GPT's replay saved 1.2x what inductor's
# whole-model capture did (docs/units/graph_capture.md); one model, so counted as equal, not more.
REPLAY_KEEPS = 1.0


def repeated_blocks(model):
    """The largest run of one module class in a ``ModuleList``/``Sequential`` of ``model`` (a GPT's
    layers, a ViT's blocks): (the container's name, the block class, the instances, their share of
    the model's parameters), or None where no container holds two or more of one class."""
    total = sum(p.numel() for p in model.parameters()) or 1
    best = None
    for name, container in model.named_modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        children = list(container.children())
        if len(children) < 2 or len({type(child) for child in children}) != 1:
            continue
        if not any(True for _ in children[0].parameters()):
            continue  # parameterless repeats (activations) are not worth a region
        share = sum(p.numel() for child in children for p in child.parameters()) / total
        if best is None or share > best[3]:
            best = (name, type(children[0]), children, share)
    return best


def traits(model, ops_per_step) -> dict:
    """What the estimate reads of the model: ops per step (the census), parameters, distinct module
    classes and the repeated blocks (count and share of the parameters)."""
    blocks = repeated_blocks(model)
    return {
        "ops_per_step": int(ops_per_step or 0),
        "parameters": sum(p.numel() for p in model.parameters()),
        "module_classes": len({type(sub) for sub in model.modules()}),
        "blocks": 0 if blocks is None else len(blocks[2]),
        "blocks_share": 0.0 if blocks is None else round(blocks[3], 3),
    }


def size(traits: dict, tier: str = "whole") -> float:
    """The graph's size in the estimate's unit: sqrt(ops), the blocks counted once when regional."""
    ops = max(1, traits["ops_per_step"])
    if tier == "regional" and traits["blocks"] > 1:
        share = traits["blocks_share"]
        ops *= 1 - share + share / traits["blocks"]
    return math.sqrt(ops)


def records_path(cache, backend) -> str:
    machine = {"backend": backend.name, "device": backend.device_key(), "torch": torch.__version__}
    return os.path.join(cache.root, ONE_OFFS, digest(machine) + ".json")


def remembered(cache, backend) -> list:
    """The one-offs measured on this machine (backend, device, torch), oldest first; none without a cache."""
    if cache is None or not cache.trusted():  # checked at every read: the folder may have been swapped
        return []
    path = records_path(cache, backend)
    if not os.path.lexists(path):
        return []
    entry = read_json(path)
    invalid = "not a JSON object" if entry is None else problem(entry, SCHEMAS["one_offs"])
    kept = [] if invalid else [record for record in entry["records"] if problem(record, SCHEMAS["one_off"]) is None]
    if not invalid and len(kept) < len(entry["records"]):
        invalid = f"{len(entry['records']) - len(kept)} record(s) of {len(entry['records'])}"
    if invalid:
        cache.note("entry_invalid", problem=invalid, path=path)
    return kept


def remember(cache, backend, record: dict) -> bool:
    """Add a measured one-off (with what was predicted for it) to this machine's records; False where
    there is no cache or it cannot be written (the record is lost, not the run)."""
    if cache is None:
        return False
    records = remembered(cache, backend) + [{**record, "date": now()}]
    with contextlib.suppress(OSError):
        cache.write_json(records_path(cache, backend), {"records": records[-KEPT:]})
        return True
    return False


def learned_rate(records: list, prior: float, warm: bool, replay: bool = False) -> tuple:
    """(seconds per unit of size, factor of uncertainty, measurements used) for a cold or warm compile,
    or for a replay tier's capture (``replay``: measured apart, it generates no code)."""
    prior = prior * (WARM_FACTOR if warm else 1.0)
    logs = [
        math.log(r["actual_s"] / r.get("load", 1.0) / r["size"])
        for r in records
        if bool(r.get("warm")) == warm
        and (r.get("tier") == "replay") == replay
        and r.get("actual_s", 0) > 0
        and r.get("size", 0) > 0
    ]
    centre = (PRIOR_WEIGHT * math.log(prior) + sum(logs)) / (PRIOR_WEIGHT + len(logs))
    spread_sq = (PRIOR_WEIGHT * math.log(PRIOR_SPREAD) ** 2 + sum((v - centre) ** 2 for v in logs)) / (
        PRIOR_WEIGHT + len(logs)
    )
    return math.exp(centre), math.exp(math.sqrt(spread_sq)), len(logs)


def estimate(traits: dict, records: list, backend, warm: bool = False, tier: str = "whole") -> dict:
    """The predicted one-off of capturing by ``tier`` (whole, regional, replay): {"seconds", "low_s",
    "high_s", "basis", "measured", "warm", "tier", "size"}, never below the least one-off
    measured on the backend for that kind of capture."""
    graph = size(traits, tier)
    replay = tier == "replay"
    prior = backend.replay_one_off_rate_s if replay else backend.capture_one_off_rate_s
    rate, spread, measured = learned_rate(records, prior, warm, replay)
    # warm or not: importing the compiler alone is 1-2 s
    floor = backend.least_replay_one_off_s if replay else backend.least_capture_one_off_s
    load = machine_load.slowdown()  # the learned rate is an idle machine's: the others' share is added
    seconds = max(floor, rate * graph) * load
    if measured:
        basis = f"{measured} one-off(s) measured on this machine, {traits['ops_per_step']} ops per step"
    else:
        basis = f"{backend.name}'s prior, {traits['ops_per_step']} ops per step"
    if warm:
        basis += ", compile cache warm"
    if load > 1:
        basis += f", {load}x for the machine's load"
    return {
        "seconds": round(seconds, 3),
        "low_s": round(max(floor * load, seconds / spread), 3),
        "high_s": round(seconds * spread, 3),
        "basis": basis,
        "measured": measured,
        "warm": warm,
        "tier": tier,
        "size": round(graph, 3),
    }


def record_of(predicted: dict, actual_s: float) -> dict:
    """What :func:`remember` keeps of a capture: its size, cache state, prediction and measurement."""
    return {
        "size": predicted["size"],
        "warm": predicted["warm"],
        "tier": predicted["tier"],
        "predicted_s": predicted["seconds"],
        "actual_s": round(actual_s, 3),
        "load": machine_load.slowdown(),  # what the machine's load made it cost: the rate learned is an idle one's
    }


def artifacts_key(backend, model, inputs, exact_random: bool):
    """What compiled code depends on: the script (path and content), the model's structure, its
    inputs' shapes, torch, the backend and device, and the compile options; None without a script
    file (``-c``, a REPL), where nothing names the run again."""
    script = script_identity()
    if script is None:
        return None
    return {
        "script": script["path"],
        "script_content": script["sha256"],
        "model": digest(model_structure(model)),
        "inputs": digest(inputs),
        "torch": torch.__version__,
        "device": f"{backend.name}: {backend.device_name()}",
        "exact_random": exact_random,
    }


def _artifacts_paths(cache, key: dict) -> tuple:
    """(the script's index, naming the key its blob was saved for; the blob for ``key``)."""
    folder = os.path.join(cache.root, *ARTIFACTS)
    return os.path.join(folder, digest(key["script"]) + ".json"), os.path.join(folder, digest(key) + ".bin")


def artifacts_lookup(cache, key) -> tuple:
    """(the blob's path or None; why: ``saved``, or ``no_cache``, ``no_script``, ``first`` (this script
    saved none), ``invalid`` (its index is not what autogaudi writes), ``changed`` (it saved one for
    another key), ``evicted``; the key's parts that changed)."""
    if cache is None:
        return None, "no_cache", []
    if key is None:
        return None, "no_script", []
    index, blob = _artifacts_paths(cache, key)
    if not os.path.lexists(index):
        return None, "first", []
    saved = read_json(index)
    invalid = "not a JSON object" if saved is None else problem(saved, SCHEMAS["artifacts_index"])
    if invalid:
        cache.note("entry_invalid", problem=invalid, path=index)
        return None, "invalid", []
    changed = [part for part in key if saved["key"].get(part) != key[part]]
    if changed:
        return None, "changed", changed
    if saved["blob"] != os.path.basename(blob):
        return None, "invalid", []
    if not os.path.lexists(blob):
        return None, "evicted", []
    return blob, "saved", []


def load_artifacts(cache, key, backend) -> dict:
    """Load the blob saved for ``key`` into torch.compile's caches, before compiling: the figures
    {"status": "hit" or "miss", "reason", "changed"}: ``loaded``, or a miss's code of
    :func:`artifacts_lookup`, ``untrusted`` (another user owns or can write where it lies: loading
    it would run their code), ``digest_mismatch`` (not the bytes this user's run saved), ``empty``
    (nothing in it for this backend) or ``unreadable``. Loading unpickles: only verified bytes are."""
    blob, reason, changed = artifacts_lookup(cache, key)
    if blob is not None:
        reason = _load_verified(cache, key, blob, backend)
    return {"status": "hit" if reason == "loaded" else "miss", "reason": reason, "changed": changed}


def _load_verified(cache, key, blob: str, backend) -> str:
    """Hand the blob's bytes to the backend where the cache and the files are trusted and the bytes'
    sha256 is the one recorded beside them when saved; the outcome's code."""
    index = _artifacts_paths(cache, key)[0]
    if not cache.trust_shared:
        levels = (cache.distrust(), distrust(index, follow=False), distrust(blob, follow=False))
        if any(levels):
            return "untrusted"
    try:
        data = read_bytes(blob)  # read once: the bytes checked are the bytes loaded
    except OSError:
        return "unreadable"
    saved = read_json(index)
    if saved is None or saved.get("sha256") != sha256(data):
        return "digest_mismatch"
    try:
        return "loaded" if backend.load_compile_artifacts(data) else "empty"
    except Exception:  # a blob torch cannot read (another build): compiled afresh
        return "unreadable"


def save_artifacts(cache, key, backend) -> bool:
    """Save what torch.compile compiled in this process for ``key``, replacing what this script saved
    before; whether anything was saved."""
    if cache is None or key is None:
        return False
    data = backend.save_compile_artifacts()
    if not data:
        return False
    index, blob = _artifacts_paths(cache, key)
    before = (read_json(index) or {}).get("blob")
    with contextlib.suppress(OSError):
        if isinstance(before, str) and before != os.path.basename(
            blob
        ):  # the script's blob for its last key: superseded
            os.unlink(os.path.join(os.path.dirname(index), os.path.basename(before)))
        cache.write_bytes(blob, data)
        record = {"key": key, "blob": os.path.basename(blob), "sha256": sha256(data), "date": now()}
        cache.write_json(index, record)
        return True
    return False


def keeps(tier: str) -> float:
    """The share of a whole capture's saving per step ``tier`` keeps (the module's ``REGIONAL_KEEPS``,
    ``REPLAY_KEEPS``: measured on few models, the trial measures the run's own)."""
    return {"whole": 1.0, "regional": REGIONAL_KEEPS, "replay": REPLAY_KEEPS}[tier]


def choose(estimates, saved_per_step_s: float, remaining) -> dict:
    """The tier that pays for itself best, of ``estimates`` (None: a tier not offered; the first of
    equals wins, so list whole first): with ``remaining`` steps known, the largest saving net of the
    one-off; with them unknown, the soonest pay-back. Regional and replay keep only part of the whole
    capture's saving per step (:func:`keeps`)."""
    offered = [estimate for estimate in estimates if estimate is not None]
    if remaining is None:
        return min(offered, key=lambda e: e["seconds"] / keeps(e["tier"]))
    saving = remaining * saved_per_step_s
    return max(offered, key=lambda e: saving * keeps(e["tier"]) - e["seconds"])
