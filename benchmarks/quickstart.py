"""The README's quick start as a newcomer runs it: plain, under autogaudi on an empty cache, and
hand-tuned, side by side, on a quiet machine and beside busy processes.

    python benchmarks/quickstart.py [--rounds 3] [--busy 0 2] [--out PATH]

The quick start is the product's first minute, so what its report claims must hold wherever it runs:
each round runs ``examples/train_mnist_mlp.py`` plain, ``python -m autogaudi`` with an empty cache (a
first run decides everything) and the hand-tuned script (the example with the one edit a user makes
for a starved loader, ``num_workers=2``), in an order that rotates from round to round, beside
``--busy`` spinning processes (``python3 -c "while True: pass"``, one setting at a time). Per run:
wall seconds, the last epoch's loss line (autogaudi's must be plain's), and for autogaudi what its
report kept and claimed (the loader's batch in-process and with workers, the whole run against
plain). Results: ``benchmarks/results/quickstart-<machine>-<commit>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parent / "examples" / "train_mnist_mlp.py"
LOADER_LINE = "shuffle=True)"  # the example's DataLoader call ends here; the hand-tuned one adds workers
HAND_TUNED_LINE = "shuffle=True, num_workers=2)"
sys.path.insert(0, str(HERE))

import against_plain  # noqa: E402  (benchmarks/ is not a package: the code's commit)
import busy  # noqa: E402  (the spinning processes)
import corpus  # noqa: E402  (the machine's name; autogaudi's bytecode, as an installed package has it)


def hand_tuned(folder: Path) -> Path:
    """The example with the user's one edit for a loader that starves the step."""
    source = EXAMPLE.read_text()
    if source.count(LOADER_LINE) != 1:
        raise SystemExit(f"{EXAMPLE} no longer builds its DataLoader with {LOADER_LINE!r}: update this benchmark")
    script = folder / "train_mnist_mlp_hand_tuned.py"
    script.write_text(source.replace(LOADER_LINE, HAND_TUNED_LINE))
    return script


def run(variant: str, scripts: dict, scratch: Path, round_: int) -> dict:
    """One whole process of ``variant``; autogaudi's with an empty cache and a JSON report."""
    report = scratch / f"{variant}-{round_}.json"
    under = ["-m", "autogaudi", "--quiet", "--report", str(report)] if variant == "autogaudi" else []
    env = {**os.environ, "AUTOGAUDI_CACHE_DIR": str(scratch / f"cache-{round_}")}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, *under, str(scripts[variant])], env=env, capture_output=True, text=True)
    record = {"seconds": round(time.perf_counter() - began, 2), "exit_code": done.returncode}
    losses = re.findall(r"epoch \d+: mean loss [0-9.]+", done.stdout)
    record["result"] = losses[-1] if losses else None
    if variant == "autogaudi" and report.exists():
        data = json.loads(report.read_text())
        loader = next(unit for unit in data["units"] if unit["name"] == "loader_workers")
        changed = {row["unit"]: row["effect"] for row in data["summary"]["changed"]}
        effect = changed.get("loader_workers", {})
        record.update(
            kept=loader["reason_code"],
            ms_per_batch=[loader["figures"].get("ms_per_batch_before"), loader["figures"].get("ms_per_batch_after")],
            speedup=effect.get("speedup"),
            claimed_against_plain_s=data["summary"]["whole_run"]["net_s"],
            claim_noise_s=data["summary"]["whole_run"]["noise_s"],
            claim_stated=data["summary"]["whole_run"]["claimed"],
        )
    return record


def claims_against_pairs(runs: dict) -> dict:
    """Each round's "against plain" (what autogaudi's report claimed, with its noise) beside what the
    round's pair measured (plain's seconds less autogaudi's), and whether it lies within the pairs'
    spread, by ``against_plain``'s rule (:func:`against_plain.claim_within`)."""
    pairs = [round(plain["seconds"] - ours["seconds"], 2) for plain, ours in zip(runs["plain"], runs["autogaudi"])]
    slower = [-saved for saved in pairs]  # against_plain's sign: autogaudi less plain
    within = []
    for ours in runs["autogaudi"]:
        saved = ours.get("claimed_against_plain_s")
        claim = {
            "slower_s": None if saved is None else -saved,
            "noise_s": ours.get("claim_noise_s"),
            "stated": ours.get("claim_stated", True),
        }
        within.append(against_plain.claim_within(claim, slower) is True)
    return {
        "pairs_s": pairs,
        "claims_s": [ours.get("claimed_against_plain_s") for ours in runs["autogaudi"]],
        "within": within,
    }


def setting(spinners: int, rounds: int, scripts: dict, scratch: Path) -> dict:
    variants = ["plain", "autogaudi", "hand-tuned"]
    runs = {variant: [] for variant in variants}
    load = [os.getloadavg()[0]]
    with busy.busy(spinners):
        for round_ in range(rounds):
            order = variants[round_ % 3 :] + variants[: round_ % 3]
            for variant in order:
                runs[variant].append(run(variant, scripts, scratch, round_))
                print(f"busy {spinners}, round {round_ + 1}: {variant} {runs[variant][-1]}", flush=True)
    load.append(os.getloadavg()[0])
    plain_s = statistics.median(r["seconds"] for r in runs["plain"])
    return {
        "busy": spinners,
        "load_before_after": [round(value, 2) for value in load],
        "runs": runs,
        "median_ratio_to_plain": {  # plain's seconds over the variant's: above 1 is faster
            variant: round(plain_s / statistics.median(r["seconds"] for r in runs[variant]), 3) for variant in variants
        },
        "autogaudi_kept_workers": sum(r.get("kept") == "workers" for r in runs["autogaudi"]),
        "claims_against_pairs": claims_against_pairs(runs),
        "results_same_as_plain": all(r["result"] == runs["plain"][0]["result"] for r in runs["autogaudi"]),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 2], help="spinning processes beside, per setting")
    parser.add_argument("--out", type=Path, help="results file (default: benchmarks/results/quickstart-...)")
    args = parser.parse_args(argv)
    corpus.compile_bytecode()
    facts = {"machine": corpus.machine_name(), "date": time.strftime("%Y-%m-%d"), "commit": against_plain._commit()}
    with tempfile.TemporaryDirectory() as folder:
        scratch = Path(folder)
        scripts = {"plain": EXAMPLE, "autogaudi": EXAMPLE, "hand-tuned": hand_tuned(scratch)}
        settings = [setting(spinners, args.rounds, scripts, scratch) for spinners in args.busy]
    out = args.out or HERE / "results" / f"quickstart-{facts['machine']}-{facts['commit']}.json"
    out.write_text(json.dumps({**facts, "settings": settings}, indent=1) + "\n")
    for row in settings:
        print(json.dumps({key: value for key, value in row.items() if key != "runs"}))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
