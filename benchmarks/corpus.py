"""Run public training scripts nobody here wrote, plain and under autogaudi, and compare what they did.

    python benchmarks/corpus.py [--corpus ../shared/corpus ...] [--cases a,b] [--short] [--jobs N] [--repeat N]

Two manifests by default: the shared corpus (``../shared/corpus``) and ``benchmarks/corpus_dist``
(distributed scripts, FSDP2 and DDP, run by torchrun on two ranks; ``--corpus`` names others). For
every case that fits the machine (``cpu`` cases without a GPU, all with one), its whole corpus is
copied to a scratch folder per variant (the scripts write next to themselves and reach for their
neighbours' files), the case's set-up commands run there, and then its command runs in a fresh
interpreter (a torchrun case's command is ``-m torch.distributed.run ...``, so the launcher wraps
torchrun and every rank runs under autogaudi):

- ``plain``: ``python script args``;
- ``autogaudi``: ``python -m autogaudi script args`` (defaults);
- ``capture forced``: ``--force graph_capture,channels_last --no-trials``, the code paths a GPU takes
  by measurement, driven on any machine;
- ``exact``: ``--exact``, only the units that leave the numbers bitwise plain's: results and
  checkpoint values must equal plain's exactly;
- on request (``--variants``): ``hpu double latest`` and ``hpu double 1.19``, the defaults with the HPU
  test double as the bridge (``tests/hpu_double``, not a Gaudi) modelling that release: a CUDA-written
  case must train with every parameter on hpu (see :func:`off_the_double`); ``hpu double latest again``
  (and ``... capture forced again``), the eager release's second run of the case in the first's cache
  folder (the recipe cache's); ``hpu double latest modes``, ``... other mode`` and ``... faster mode``,
  hpu_mode's three runs where asked for (``--trial hpu_mode``); ``precision bf16``, ``fp16``, ``tf32``
  and ``auto`` (``--precision``).

Per case and variant it records the exit code (must equal plain's), the result line (the manifest's
regex, last match; its numbers compared with plain's, see :func:`compare_results`), the wall time
(with ``--repeat N``, plain's and autogaudi's are the median of N runs in rounds of alternating
order: single runs move about +-0.1x) and its ratio to plain, autogaudi's JSON report, and every
file the run wrote: the same files must exist under autogaudi (names that carry a time compared by
kind), and each checkpoint must load with plain ``torch.load`` in a process without autogaudi,
holding the same keys, dtypes and shapes as plain's, and values whose sums are within the result
tolerance of plain's (for scripts that print no result, the only check of what they computed).
Writes ``benchmarks/results/corpus-<machine>.{json,md}``; the test suite runs the ``cpu`` cases with
``--short`` (the cases' own arguments made shorter; the scripts are never edited).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_CORPUS = REPO.parent / "shared" / "corpus"
DIST_CORPUS = HERE / "corpus_dist"
HPU_DOUBLE = REPO / "tests" / "hpu_double"

VARIANTS = {
    "plain": [],
    "autogaudi": ["-m", "autogaudi"],
    "capture forced": ["-m", "autogaudi", "--force", "graph_capture,channels_last", "--no-trials"],
    "exact": ["-m", "autogaudi", "--exact"],
    # The defaults with the HPU test double (tests/hpu_double) as the bridge, per release it models:
    # where a Gaudi is out of reach, whether a CUDA- or CPU-written case ends up with its model on hpu.
    "hpu double latest": ["-m", "autogaudi"],
    # The second run in the first's cache folder: the release's default mode again (hpu_mode measures the
    # modes only where asked), so every graph is one the first run compiled.
    "hpu double latest again": ["-m", "autogaudi"],
    # Short runs end before graph_capture's trial would start: forced, the first run compiles its
    # regions with hpu_backend and the second, in the first's cache folder, must find every recipe.
    "hpu double latest capture forced": ["-m", "autogaudi", "--force", "graph_capture", "--no-trials"],
    "hpu double latest capture forced again": ["-m", "autogaudi", "--force", "graph_capture", "--no-trials"],
    "hpu double 1.19": ["-m", "autogaudi"],
    # hpu_mode's choice, asked for (--trial hpu_mode), three runs on the same script path and cache: the
    # first measures the release's default mode (eager), the second tries the other (lazy), the third sets
    # the faster of the two measured.
    "hpu double latest modes": ["-m", "autogaudi", "--trial", "hpu_mode"],
    "hpu double latest other mode": ["-m", "autogaudi", "--trial", "hpu_mode"],
    "hpu double latest faster mode": ["-m", "autogaudi", "--trial", "hpu_mode"],
    # On request only (--variants): mixed precision changes numerics by design.
    "precision bf16": ["-m", "autogaudi", "--precision", "bf16"],
    "precision auto": ["-m", "autogaudi", "--precision", "auto"],
    "precision fp16": ["-m", "autogaudi", "--precision", "fp16"],
    "precision tf32": ["-m", "autogaudi", "--precision", "tf32"],
}
DEFAULT_VARIANTS = ("plain", "autogaudi", "capture forced", "exact")
# The result line's numbers against plain's: relative, per number. Fused kernels and compiled code
# reassociate float sums, and a trajectory drifts over hundreds of steps (5%). Forced capture also
# draws dropout masks from another random stream (same distribution): a different trajectory of the
# same training, compared loosely (25%), and the table says so.
# Below float32 (bf16 keeps 8 significant bits, fp16 11, tf32's matmuls 11): a different trajectory
# too, held to 25% like forced capture.
TOLERANCE = {
    "plain": 0.0,
    "autogaudi": 0.05,
    "capture forced": 0.25,
    "exact": 0.0,
}  # exact: bitwise
TOLERANCE.update((variant, 0.25) for variant in VARIANTS if variant.startswith("precision "))
# The double's release per variant (HPU_DOUBLE_RELEASE). Its device is this machine's CPU: results are
# held to the default's tolerance (the hpex kernels' formulas differ from torch's by rounding).
HPU_DOUBLE_RELEASE = {variant: "latest" for variant in VARIANTS if variant.startswith("hpu double latest")}
HPU_DOUBLE_RELEASE["hpu double 1.19"] = "1.19"
TOLERANCE.update(dict.fromkeys(HPU_DOUBLE_RELEASE, 0.05))
TOLERANCE.update(dict.fromkeys(("hpu double latest capture forced", "hpu double latest capture forced again"), 0.25))
# A second run and the variant whose cache folder it runs in (the first run's: it must compile nothing).
AGAIN = {
    "hpu double latest again": "hpu double latest",
    "hpu double latest capture forced again": "hpu double latest capture forced",
}
# Runs that continue an earlier variant's: its cache folder, and its copy of the corpus at the same
# path (hpu_mode remembers step times per script path).
LATER_RUN = {
    **AGAIN,
    "hpu double latest other mode": "hpu double latest modes",
    "hpu double latest faster mode": "hpu double latest modes",
}
# Cases whose results and checkpoint values cannot be compared with another run's, and why.
NOT_COMPARED = {
    "regression": "the script draws unseeded random data every step; its exit (converged) is compared",
    "ddp": "the script's dataset is unseeded torch.rand; its exit and checkpoint's shapes are compared",
    **dict.fromkeys(
        ("fsdp2", "fsdp2-dcp-resume"),
        "the script never initialises its layers' weights (to_empty, then the root's reset_parameters, which "
        "skips the layers: whatever memory held, NaN after training here); exit, files and checkpoint shapes "
        "are compared",
    ),
}
# torch 2.13's gloo sometimes aborts a rank at teardown after its work is done (also plain, also in
# the test suite, tests/helpers.py): such a run is run again, at most twice more, and says so.
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"
# A variant whose whole run takes this much longer than plain's is "slower".
SLOWER = 1.10
# The variants ``--repeat`` runs again for their wall times: the default's speed against plain is
# within run-to-run noise (about +-0.1x in single runs); the others' verdicts are about behaviour,
# and forced capture's one-off dwarfs that noise.
REPEATED = ("plain", "autogaudi")
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
# --short: each case's own arguments, shortened (name -> (argument replacements, the result regex
# that then matches the last report line)). For a CI run on 2 cores; the scripts stay as they are.
# An argument may become several: minGPT's adder on one-digit sums (its evaluation at iteration 0
# then reads 100 problems, not 10,000) and chargpt on 32-character blocks, not 128 (its 500
# sampled characters at iteration 0 and each step attend over a quarter of the context): the same
# code paths, each unit reaching a decision as in the longer run, with less arithmetic on the way.
ADDER_SHORT = (
    {"--trainer.max_iters=300": ["--trainer.max_iters=40", "--data.ndigit=1"]},
    r"iter 30: train loss [0-9.]+",
)
SHORT = {
    "mingpt-adder": ADDER_SHORT,
    "mingpt-adder-workers": ADDER_SHORT,
    "mingpt-chargpt": (
        {"--trainer.max_iters=100": ["--trainer.max_iters=20", "--data.block_size=32"]},
        r"iter_dt [0-9.]+ms; iter [0-9]+: train loss [0-9.]+",
    ),
    "makemore-transformer": ({"150": ["40"]}, r"step 30 \| loss [0-9.]+"),
    "makemore-gru": ({"150": ["40"]}, r"step 30 \| loss [0-9.]+"),
}
# Numbers in a result line that are timings, not results ("iter_dt 12.3ms").
TIMING = re.compile(r"[0-9.]+\s*m?s\b")
NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")

# Each checkpoint's tensors, nested dicts flattened ("MODEL_STATE.weight", "state.0.exp_avg"), with
# their dtype and shape, and (sum, sum of absolute values) of the floating ones.
LOAD_CHECKPOINTS = r"""
import json, sys, torch
def flat(value, prefix=""):
    for key, item in (value.items() if isinstance(value, dict) else ()):
        name = f"{prefix}{key}"
        if isinstance(item, torch.Tensor):
            yield name, item
        else:
            yield from flat(item, name + ".")
summaries = {}
for name, path in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        value = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        summaries[name] = {"error": f"{type(error).__name__}: {error}"[:300]}
        continue
    if isinstance(value, torch.nn.Module):
        kind, value = f"module {type(value).__name__}", value.state_dict()
    else:
        kind = type(value).__name__
    tensors = dict(flat(value))
    summaries[name] = {"kind": kind, "tensors": {k: [str(v.dtype), list(v.shape)] for k, v in tensors.items()},
                       "sums": {k: [float(v.double().sum()), float(v.double().abs().sum())]
                                for k, v in tensors.items() if v.is_floating_point()}}
print(json.dumps(summaries))
"""
# The double's variants run with this as ``sitecustomize`` (a folder of the harness's first on
# PYTHONPATH): at the script's exit, in its main process only, it writes what the double counted (its
# metrics, as the bridge's API returns them) and the device of every parameter an optimizer holds, to
# CORPUS_DOUBLE_FACTS. It imports nothing at start: torch and the bridge load when the script loads them.
DOUBLE_FACTS = r"""
import atexit, gc, json, os, sys
_MAIN = os.getpid()
def _facts():
    if os.getpid() != _MAIN:
        return
    facts = {"bridge_loaded": "habana_frameworks.torch" in sys.modules, "optimizer_parameters": {}}
    if facts["bridge_loaded"]:
        from habana_frameworks.torch import _release
        from habana_frameworks.torch.hpu import metrics
        facts["release"] = _release.RELEASE
        facts["recipe_cache_config"] = metrics.RECIPE_CACHE  # as the bridge read it when it loaded
        facts["metrics"] = {name: dict(metrics.metric_global(name).stats())
                            for name in ("graph_compilation", "recipe_cache")}
    optim = getattr(sys.modules.get("torch"), "optim", None)
    for held in gc.get_objects() if optim is not None else ():
        if issubclass(type(held), optim.Optimizer):  # type(): a dead weak proxy raises on isinstance
            for group in held.param_groups:
                for parameter in group["params"]:
                    kind = parameter.device.type
                    facts["optimizer_parameters"][kind] = facts["optimizer_parameters"].get(kind, 0) + 1
    with open(os.environ["CORPUS_DOUBLE_FACTS"], "w") as out:
        json.dump(facts, out)
atexit.register(_facts)
"""


def machine_name() -> str:
    sys.path.insert(0, str(HERE))
    from run import machine_name as name  # noqa: PLC0415 (benchmarks/ is not a package)

    return name()


def load_cases(corpora: list, where: str, names) -> list:
    """The cases of every corpus's manifest (each remembers its corpus), those that fit ``where``
    unless named."""
    every = [
        {**case, "corpus": corpus}
        for corpus in corpora
        for case in json.loads((corpus / "corpus.json").read_text())["cases"]
    ]
    if names:
        unknown = sorted(set(names) - {case["name"] for case in every})
        if unknown:
            raise SystemExit(f"unknown case(s) {', '.join(unknown)}; valid: " + ", ".join(c["name"] for c in every))
        return [case for case in every if case["name"] in names]
    return [case for case in every if where in case["where"]]


def shortened(case: dict) -> dict:
    replacements, result = SHORT.get(case["name"], ({}, case["result"]))
    command = [new for arg in case["command"] for new in replacements.get(arg, [arg])]
    return {**case, "command": command, "result": result}


def missing_requirements(case: dict) -> list:
    return [name for name in case.get("requires", ()) if importlib.util.find_spec(name) is None]


def clean_env(case: dict, variant: str) -> dict:
    """The user's environment less autogaudi's own variables, plus the case's; autogaudi variants
    find the package from this checkout even where it is not installed (the GPU machine)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("AUTOGAUDI")}
    env.update(case.get("env", {}))
    env["PYTHONUNBUFFERED"] = "1"
    if VARIANTS[variant]:
        env["PYTHONPATH"] = os.pathsep.join(part for part in (env.get("PYTHONPATH"), str(REPO)) if part)
    if variant in HPU_DOUBLE_RELEASE:
        env["PYTHONPATH"] = os.pathsep.join((str(HPU_DOUBLE), env["PYTHONPATH"]))
        env["HPU_DOUBLE_RELEASE"] = HPU_DOUBLE_RELEASE[variant]
        env.pop("PT_HPU_LAZY_MODE", None)  # the variant names the release: its default mode, or hpu_mode's
    return env


def snapshot(folder: Path) -> dict:
    return {
        str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in folder.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def normalised(name: str) -> str:
    """File names that carry a time, host or process id (TensorBoard's event files, a checkpoint
    folder named by the time in ms: FSDP2's example) compared by kind."""
    name = re.sub(r"events\.out\.tfevents\..*", "events.out.tfevents.*", name)
    return re.sub(r"(^|/)[0-9]{10,}(?=/)", r"\1<time>", name)


def written_files(before: dict, after: dict) -> list:
    return sorted(name for name, stamp in after.items() if before.get(name) != stamp)


def result_numbers(text):
    return None if text is None else [float(n) for n in NUMBER.findall(TIMING.sub("", text))]


def compare_results(case: dict, variant: str, plain, mine) -> tuple:
    """(same, why): the numbers of the result line within ``TOLERANCE[variant]`` of plain's."""
    if case["name"] in NOT_COMPARED:
        return True, f"not compared: {NOT_COMPARED[case['name']]}"
    if case.get("result") is None:
        return True, "the script prints no result: its checkpoints' values are compared"
    if mine is None:
        return False, "no result line"
    if plain is None:
        return True, "plain printed no result line"
    a, b = result_numbers(mine), result_numbers(plain)
    if len(a) != len(b):
        return False, f"result {mine!r} is not shaped like plain's {plain!r}"
    worst = max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)
    bound = TOLERANCE[variant]
    if worst > bound:
        return False, f"result differs by {worst:.1%} (bound {bound:.0%}): {mine!r} vs plain {plain!r}"
    return True, f"within {bound:.0%} (largest difference {worst:.2%})"


def different_sums(case: dict, variant: str, plain: dict, mine: dict) -> list:
    """The floating tensors of a checkpoint whose sum is further from plain's than the result
    tolerance, in units of plain's sum of absolute values (a sum near zero is not a scale), or
    finite where plain's is not, or the other way round."""
    if case["name"] in NOT_COMPARED:
        return []
    bound = TOLERANCE[variant]

    def far(total, plain_total, plain_size):
        if not (math.isfinite(total) and math.isfinite(plain_total)):
            return math.isfinite(total) != math.isfinite(plain_total)
        return abs(total - plain_total) > bound * max(plain_size, 1e-12)

    theirs = plain.get("sums", {})
    return [
        name for name, (total, _size) in mine.get("sums", {}).items() if name in theirs and far(total, *theirs[name])
    ]


def check_checkpoints(folder: Path, files: list, case: dict) -> dict:
    """Load each checkpoint with plain torch (no autogaudi in that process), in the case's folder;
    summaries by normalised name."""
    checkpoints = [name for name in files if name.endswith(CHECKPOINT_SUFFIXES)]
    if not checkpoints:
        return {}
    env = clean_env(case, "plain")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(folder / case["dir"])) if p)
    done = subprocess.run(
        [sys.executable, "-c", LOAD_CHECKPOINTS, *(part for name in checkpoints for part in (normalised(name), name))],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        return {name: {"error": done.stderr[-300:]} for name in checkpoints}
    return json.loads(done.stdout.splitlines()[-1])


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def again_after_teardown_abort(run, exit_code_and_output) -> tuple:
    """``run()``, run again, at most twice more, while its result (read by ``exit_code_and_output``)
    ended in gloo's teardown abort; the last result and how many runs came after the first."""
    result = run()
    for again in range(1, 3):
        exit_code, output = exit_code_and_output(result)
        if exit_code == 0 or GLOO_TEARDOWN_ABORT not in output:
            return result, again - 1
        result = run()
    return result, 2


def run_setup(case: dict, folder: Path) -> None:
    """The case's set-up commands, plain, each run again after gloo's teardown abort as the measured
    runs are (a set-up that fails otherwise raises: the case cannot be measured)."""
    env = clean_env(case, "plain")
    for command in case.get("setup", ()):
        done, _ = again_after_teardown_abort(
            lambda command=command: subprocess.run(
                [sys.executable, *command], cwd=folder, env=env, capture_output=True, text=True, timeout=600
            ),
            lambda done: (done.returncode, done.stderr),
        )
        done.check_returncode()


def run_variant(case: dict, variant: str, scratch: Path, timeout: float) -> dict:
    root = scratch / case["name"] / variant.replace(" ", "-")
    shutil.rmtree(root, ignore_errors=True)  # a run again starts from a fresh copy
    # A fresh cache folder: the figures are a first run's, with nothing remembered or compiled; a
    # later run's (LATER_RUN) is its first run's, as is the path of its (fresh) copy.
    cache = scratch / case["name"] / LATER_RUN[variant].replace(" ", "-") if variant in LATER_RUN else root
    copy = cache / "corpus"
    shutil.rmtree(copy, ignore_errors=True)
    root.mkdir(parents=True)
    shutil.copytree(case["corpus"], copy, ignore=shutil.ignore_patterns("__pycache__"))
    folder = copy / case["dir"]
    run_setup(case, folder)
    before = snapshot(copy)
    report_path = root / "autogaudi-report.json"
    extra = [*VARIANTS[variant], "--report", str(report_path)] if VARIANTS[variant] else []
    env = {**clean_env(case, variant), "AUTOGAUDI_CACHE_DIR": str(cache / "autogaudi-cache")}
    facts_path = root / "double-facts.json"
    if variant in HPU_DOUBLE_RELEASE:
        (root / "site").mkdir()
        (root / "site" / "sitecustomize.py").write_text(DOUBLE_FACTS)
        env["PYTHONPATH"] = os.pathsep.join((str(root / "site"), env["PYTHONPATH"]))
        env["CORPUS_DOUBLE_FACTS"] = str(facts_path)
    began = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, *extra, *case["command"]],
            cwd=folder,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as expired:
        done = subprocess.CompletedProcess(
            expired.cmd,
            f"timed out after {timeout} s",
            _text(expired.stdout),
            _text(expired.stderr) + f"\nkilled after {timeout} s",
        )
    seconds = time.perf_counter() - began
    matches = re.findall(f"(?:{case['result']})", done.stdout + done.stderr) if case.get("result") else []
    files = written_files(before, snapshot(copy))
    record = {
        "exit_code": done.returncode,
        "seconds": round(seconds, 2),
        "result": matches[-1] if matches else None,
        "files": sorted({normalised(name) for name in files}),
        "checkpoints": check_checkpoints(copy, files, case),
        "output_tail": (done.stdout[-1500:] + "\n--- stderr ---\n" + done.stderr[-3000:]).strip(),
    }
    if report_path.exists():
        record["report"] = json.loads(report_path.read_text())
    if facts_path.exists():
        record["double"] = json.loads(facts_path.read_text())
    return record


def verdict(case: dict, variant: str, plain: dict, mine: dict) -> dict:
    """same / differs / crashed / slower, with every reason found (worst first)."""
    problems = {"crashed": [], "differs": [], "slower": []}
    exits = set(mine.get("exit_codes", [mine["exit_code"]]))
    if exits != {plain["exit_code"]}:
        problems["crashed"].append(f"exit code {', '.join(map(str, sorted(exits)))}, plain {plain['exit_code']}")
    same, why = compare_results(case, variant, plain["result"], mine["result"])
    if not same:
        problems["differs"].append(why)
    # a unit that raised inside the run was switched off and the run went on (fail-open): the user saw
    # plain's behaviour, but it is autogaudi's bug all the same
    problems["crashed"] += [
        f"{unit['name']} failed inside the run: {unit['reason']}"
        for unit in (mine.get("report") or {}).get("units", [])
        if unit.get("status") == "failed"
    ]
    if variant in HPU_DOUBLE_RELEASE:
        problems["differs"] += off_the_double(mine.get("report") or {}, mine.get("double"))
    if variant in AGAIN:
        problems["differs"] += compiled_again(mine.get("double"))
    missing = sorted(set(plain["files"]) - set(mine["files"]))
    if missing:
        problems["crashed" if mine["exit_code"] else "differs"].append(f"files plain wrote are missing: {missing}")
    for name, summary in mine["checkpoints"].items():
        if "error" in summary and "error" not in plain["checkpoints"].get(name, {"error": None}):
            problems["crashed"].append(f"{name} does not load with plain torch.load: {summary['error']}")
        elif name in plain["checkpoints"]:
            theirs = plain["checkpoints"][name]
            wrong = different_sums(case, variant, theirs, summary)
            if (summary.get("kind"), summary.get("tensors")) != (theirs.get("kind"), theirs.get("tensors")):
                problems["differs"].append(f"{name} holds other keys, dtypes or shapes than plain's")
            elif wrong:
                problems["differs"].append(
                    f"{name}: values further from plain's than {TOLERANCE[variant]:.0%} ({wrong[0]}, ...)"
                )
    ratio = mine["seconds"] / plain["seconds"]
    if ratio > SLOWER:
        problems["slower"].append(f"whole run {ratio:.2f}x plain's wall time")
    worst = next((kind for kind, found in problems.items() if found), "same")
    return {
        "verdict": worst,
        "why": [text for found in problems.values() for text in found] or [why],
        "time_ratio": round(ratio, 3),
    }


def off_the_double(report: dict, facts) -> list:
    """Why the model is not on the double's hpu where it should be: a script that asks for CUDA is
    migrated there, every parameter its optimizers hold on hpu at exit (its batches then are too: the
    double raises where a host tensor meets an HPU one, as a Gaudi does); one written for the CPU
    stays on the host, as written (gpu_migration's ``script_not_cuda``), the device units stepping aside."""
    placement = report.get("backend", {}).get("placement", {})
    migration = {unit["name"]: unit for unit in report.get("units", [])}.get("gpu_migration", {})
    if migration.get("reason_code") == "script_not_cuda":
        return []
    if not placement.get("on_device"):
        return [f"the model's parameters on {placement.get('device', 'an unknown device')}, not hpu"]
    held = (facts or {}).get("optimizer_parameters", {})
    if set(held) - {"hpu"}:
        return [f"parameters the optimizers hold at exit, by device: {held}"]
    return []


def compiled_again(facts) -> list:
    """Why a second run in the first's cache folder is not the recipe cache's: by the double's
    graph_compilation and recipe_cache metrics at its exit, it compiled a graph, or found none cached
    (a run that compiles nothing at all shows no cache at work)."""
    metrics = (facts or {}).get("metrics")
    if metrics is None:
        return ["the double's metrics were not read (the bridge was not loaded)"]
    compiled, cache = metrics["graph_compilation"]["TotalNumber"], metrics["recipe_cache"]
    if compiled:
        return [f"the second run compiled {compiled} graph(s); recipe cache {cache}"]
    if not cache["TotalHit"]:
        return [f"no recipe cache hit: no graph compiled to be found again; recipe cache {cache}"]
    return []


def run_variant_again_after_teardown_abort(case: dict, variant: str, scratch: Path, timeout: float) -> dict:
    """One run of ``variant``; run again, at most twice more, where it ended in gloo's teardown abort
    (plain or not)."""
    run, again = again_after_teardown_abort(
        lambda: run_variant(case, variant, scratch, timeout), lambda run: (run["exit_code"], run["output_tail"])
    )
    return {**run, "runs_after_teardown_abort": again} if again else run


def repeat_timed(case: dict, runs: dict, scratch: Path, timeout: float, repeat: int) -> None:
    """Run the variants in ``REPEATED`` ``repeat - 1`` more times, rounds in alternating order (drift
    cancels), and make each one's ``seconds`` the median of its runs (all kept in ``seconds_runs``,
    with every run's exit code)."""
    timed = [variant for variant in REPEATED if variant in runs]
    for round_ in range(1, repeat):
        for variant in timed if round_ % 2 else timed[::-1]:
            again = run_variant_again_after_teardown_abort(case, variant, scratch, timeout)
            runs[variant].setdefault("seconds_runs", [runs[variant]["seconds"]]).append(again["seconds"])
            runs[variant].setdefault("exit_codes", [runs[variant]["exit_code"]]).append(again["exit_code"])
    for variant in timed:
        if "seconds_runs" in runs[variant]:
            runs[variant]["seconds"] = round(statistics.median(runs[variant]["seconds_runs"]), 2)


def run_case(case: dict, variants: list, scratch: Path, log, timeout: float, repeat: int = 1) -> dict:
    missing = missing_requirements(case)
    if missing:
        return {"name": case["name"], "skipped": f"needs {', '.join(missing)}, not installed here"}
    runs = {}
    for variant in variants:
        runs[variant] = run_variant_again_after_teardown_abort(case, variant, scratch, timeout)
        log(
            f"  {case['name']}: {variant} exit {runs[variant]['exit_code']} in {runs[variant]['seconds']:.1f} s, "
            f"result {runs[variant]['result']!r}"
        )
    repeat_timed(case, runs, scratch, timeout, repeat)
    row = {"name": case["name"], "command": case["command"], "traits": case.get("traits", ""), "runs": runs}
    plain = runs.get("plain")
    if plain is not None and plain["exit_code"] != 0:
        row["plain_failed"] = plain["output_tail"][-600:]
    if plain is not None:
        for variant in variants[1:]:
            runs[variant].update(verdict(case, variant, plain, runs[variant]))
    return row


def hpu_mode_choice(report: dict) -> list:
    """hpu_mode's decision in this run (its reason code and mode) and the step times it has measured
    so far (the double's: this machine's CPU times, not a Gaudi's)."""
    unit = {unit["name"]: unit for unit in report.get("units", [])}.get("hpu_mode")
    if not unit or unit["status"] == "skipped":
        return []
    figures = unit.get("figures", {})
    measured = ", ".join(
        f"{mode} {figures[f'{mode}_ms_per_step']} ms/step"
        for mode in ("eager", "lazy")
        if figures.get(f"{mode}_ms_per_step")
    )
    return [
        f"hpu_mode: {unit['reason_code']}, {figures.get('mode')} mode"
        + (f" (measured: {measured})" if measured else "")
    ]


def what_autogaudi_did(run: dict) -> str:
    """The units that changed something or measured, the trials, and what the double counted, in one cell."""
    report = run.get("report")
    if not report:
        return "no report"
    parts = []
    for unit in report.get("units", []):
        if (
            unit["name"]
            in (
                "graph_capture",
                "channels_last",
                "loader_workers",
                "fused_optimizer",
                "step_profiler",
                "mixed_precision",
            )
            and unit["status"] != "skipped"
        ):
            parts.append(f"{unit['name']}: {unit['reason']}"[:160])
        elif unit["status"] == "failed":
            parts.append(f"{unit['name']} FAILED: {unit['reason']}"[:200])
    parts += hpu_mode_choice(report)
    placement = report.get("backend", {}).get("placement")
    if placement and "hpu" in report.get("backend", {}).get("name", ""):
        migration = report["backend"].get("migration")
        parts.append(
            f"parameters on {placement['device']} at {placement['at']}"
            + (f", asked for {migration['asked_for']}" if migration else ", not migrated")
        )
    if "double" in run:
        double = run["double"]
        parts.append(
            f"on the double ({double.get('release')}): optimizers' parameters {double['optimizer_parameters']}"
        )
        if "metrics" in double:
            metrics = double["metrics"]
            parts.append(
                f"graphs compiled {metrics['graph_compilation']['TotalNumber']}, recipe cache {metrics['recipe_cache']}"
            )
    for trial in report.get("trials", []):
        parts.append(
            f"trial {trial['candidate']}: {trial.get('speedup')}x, one-off {trial.get('one_off_s')} s, "
            f"{trial.get('decision')}"
        )
    return "; ".join(parts)


def _code(text) -> str:
    """A result line as a table cell: in backticks, its pipes escaped (makemore prints 'step 140 | loss')."""
    return f"`{str(text).replace('|', chr(92) + '|')}`"


def markdown(results: dict) -> str:
    variants = results["variants"]
    lines = [
        f"# Corpus on {results['machine']} (torch {results['torch']}, {results['mode']})",
        "",
        f"Run {results.get('date', 'on a date not recorded')}, code of commit {results.get('commit', 'not recorded')}.",
        "",
        f"Cases run {results['jobs']} at a time; whole-process wall times (interpreter start, set-up "
        "excluded; autogaudi's bytecode compiled beforehand, as an install leaves it"
        + (
            f"; {' and '.join(REPEATED)}: the median of {results['repeat']} runs, in rounds of alternating order"
            if results.get("repeat", 1) > 1
            else ""
        )
        + "). Verdicts against plain: same / differs / crashed / slower "
        f"(> {SLOWER:.2f}x plain's wall time). Result tolerance: "
        + ", ".join(f"{v} {TOLERANCE[v]:.0%}" for v in variants[1:])
        + " relative, per number "
        "(forced capture draws dropout masks from another stream).",
        "",
        *(f"- {note}" for note in results.get("notes", ())),
        "",
        "| case | " + " | ".join(variants) + " |",
        "|---" * (len(variants) + 1) + "|",
    ]
    for row in results["cases"]:
        if "skipped" in row:
            lines.append(f"| {row['name']} | not run: {row['skipped']} |" + " |" * (len(variants) - 1))
            continue
        cells = []
        for variant in variants:
            run = row["runs"][variant]
            if variant == "plain":
                cells.append(f"exit {run['exit_code']}, {run['seconds']:.1f} s, {_code(run['result'])}")
            else:
                cells.append(
                    f"**{run['verdict']}** {run['time_ratio']:.2f}x, exit {run['exit_code']}, {_code(run['result'])}"
                )
        lines.append(f"| {row['name']} | " + " | ".join(cells) + " |")
    lines += ["", "## Details", ""]
    for row in results["cases"]:
        if "skipped" in row:
            continue
        lines.append(f"### {row['name']}: `{' '.join(row['command'])}`")
        lines.append(f"Traits: {row['traits']}")
        if "plain_failed" in row:
            lines.append(f"- plain failed: `{row['plain_failed'][-300:]}`")
        for variant in variants[1:]:
            run = row["runs"][variant]
            lines.append(f"- {variant}: **{run['verdict']}** ({'; '.join(run['why'])}). {what_autogaudi_did(run)}")
        lines.append("")
    return "\n".join(lines) + "\n"


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def compile_bytecode() -> None:
    """autogaudi's modules compiled to bytecode before any run, as pip leaves an installed package
    (and left torch). Where bytecode is not written (``PYTHONDONTWRITEBYTECODE``, set on the 2-core
    sandbox) an editable install compiled its ten thousand lines again in every process: 0.15-0.2 s
    of each run there, which autogaudi's users do not pay and plain's torch did not."""
    import compileall

    import autogaudi

    compileall.compile_dir(Path(autogaudi.__file__).parent, quiet=1)


def new_results(where: str, jobs: int, short: bool, variants: list, repeat: int = 1) -> dict:
    """A results file's header, with no case yet."""
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "machine": machine_name(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit.stdout.strip() or "unknown",
        "torch": torch.__version__,
        "where": where,
        "jobs": jobs,
        "repeat": repeat,
        "mode": "short runs (--short)" if short else "the manifest's commands",
        "variants": variants,
        "tolerance": {v: TOLERANCE[v] for v in variants},
        "cases": [],
    }


def write(results: dict, out: Path) -> None:
    """The JSON and the Markdown table beside it."""
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    out.with_suffix(".md").write_text(markdown(results))


def default_name(variants: list) -> str:
    """``corpus-<machine>.json``; on the double, ``corpus-hpu-double-<release>-<machine>.json`` (the
    double's device is that machine's CPU)."""
    releases = sorted({HPU_DOUBLE_RELEASE[variant] for variant in variants if variant in HPU_DOUBLE_RELEASE})
    prefix = f"hpu-double-{'-'.join(releases)}-" if releases else ""
    return f"corpus-{prefix}{machine_name()}.json"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--corpus",
        type=Path,
        action="append",
        help=f"a corpus folder with its corpus.json, repeatable (default: {DEFAULT_CORPUS} and {DIST_CORPUS})",
    )
    parser.add_argument("--cases", help="comma-separated case names (default: every case that fits the machine)")
    parser.add_argument("--where", choices=("cpu", "gpu"), help="default: gpu when CUDA is available, else cpu")
    parser.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma-separated, plain first (default: {', '.join(DEFAULT_VARIANTS)}): {', '.join(VARIANTS)}",
    )
    parser.add_argument("--short", action="store_true", help="shorter runs through the cases' own arguments (CI)")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once (timings then share the machine)")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/corpus-<machine>.json")
    parser.add_argument("--scratch", type=Path, help="where the copies run (default: a temporary folder)")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help=f"runs of {' and '.join(REPEATED)} per case, their wall times the median (the others run once)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one run may take before it is killed")
    args = parser.parse_args(argv)
    import torch

    variants = args.variants.split(",")
    if variants[0] != "plain" or set(variants) - set(VARIANTS):
        parser.error(f"--variants must start with plain and name only: {', '.join(VARIANTS)}")
    for again, first in LATER_RUN.items():
        if again in variants and first not in variants[: variants.index(again)]:
            parser.error(f"--variants: {again!r} is the second run of {first!r}, which must come before it")
    where = args.where or ("gpu" if torch.cuda.is_available() else "cpu")
    corpora = args.corpus or [corpus for corpus in (DEFAULT_CORPUS, DIST_CORPUS) if (corpus / "corpus.json").exists()]
    cases = load_cases(corpora, where, args.cases.split(",") if args.cases else None)
    if args.short:
        cases = [shortened(case) for case in cases]
    out = args.out or HERE / "results" / default_name(variants)
    scratch = args.scratch or Path(tempfile.mkdtemp(prefix="autogaudi-corpus-"))
    results = new_results(where, args.jobs, args.short, variants, args.repeat)
    compile_bytecode()
    out.parent.mkdir(parents=True, exist_ok=True)
    order = {case["name"]: index for index, case in enumerate(cases)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        pending = [pool.submit(run_case, case, variants, scratch, log, args.timeout, args.repeat) for case in cases]
        for finished in concurrent.futures.as_completed(pending):  # written as cases end: a cut run keeps its rows
            results["cases"] = sorted([*results["cases"], finished.result()], key=lambda row: order[row["name"]])
            write(results, out)
    rows = results["cases"]
    print(markdown(results))
    if not args.scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    failed = [row["name"] for row in rows for run in row.get("runs", {}).values() if run.get("verdict") == "crashed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
