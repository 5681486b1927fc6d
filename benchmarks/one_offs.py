"""Capture one-offs: predicted against actual, first run against second, whole model against regional.

    python benchmarks/one_offs.py [--models w3,rl,chargpt,adder,makemore] [--regions gpt4,mingpt] [--quick]
        [--device cpu|cuda] [--corpus ../shared/corpus] [--out benchmarks/results/one_offs-<machine>.json]

Two tables:

- *Runs* (``--models``): each model's script under ``python -m autogaudi --force graph_capture``,
  three times in fresh processes sharing one autogaudi cache folder that starts empty: *first*
  (inductor's cache in a new empty folder, ``TORCHINDUCTOR_CACHE_DIR``), *second* (the same inductor
  folder: everything warm), *second, inductor emptied* (a new empty inductor folder: only what
  autogaudi's cache kept, the saved compile artifacts and the one-offs it learned from). Figures from
  graph_capture's report row: the predicted one-off and its range, the actual one-off (set-up and
  first compile: what the estimate predicts; and every part of the one-off), the artifacts' hit or
  miss, the whole run's wall clock and steps/s.
- *Regions* (``--regions``): a GPT trained in a child process under autogaudi with capture forced as
  whole model or by region (the unit's choice pinned through ``one_offs.REGIONAL_KEEPS``), on CUDA
  also by the replay tier (CUDA graphs of torch's own kernels, pinned through ``REPLAY_KEEPS``), each
  with an empty inductor folder, and eagerly: the predicted and actual one-off and the steady ms/step
  (the median of the steps after the compile, each step synchronized on a GPU).

``--quick``: fewer steps (the workloads' ``--steps 30``, the corpus cases shortened as corpus.py's
``--short``; 20 timed steps in the regions). The machine's load average is recorded with each row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import corpus  # noqa: E402
import run as suite  # noqa: E402
import second_run  # noqa: E402

from autogaudi.optimizations.graph_capture.unit import ONE_OFF_PARTS  # noqa: E402

QUICK = ["--steps", "30", "--warmup", "10"]
WORKLOADS = {"w3": "cnn.py", "rl": "rl_policy.py"}
CORPUS_CASES = {"chargpt": "mingpt-chargpt", "adder": "mingpt-adder", "makemore": "makemore-transformer"}
RUNS = ("first", "second", "second, inductor emptied")


def load() -> float:
    return round(os.getloadavg()[0], 2)


def capture_figures(report: dict) -> dict:
    figures = second_run.graph_capture_row(report)["figures"]
    wanted = (
        "capture_tier",
        "one_off_predicted_s",
        "one_off_predicted_range_s",
        "one_off_predicted_basis",
        "one_off_actual_s",
    )
    return {
        **{key: figures.get(key) for key in wanted},
        "one_off_s": round(sum(figures.get(part, 0.0) for part in ONE_OFF_PARTS), 3),
        "compile_artifacts": figures.get("compile_artifacts", {}).get("status"),
        "artifacts_reason": figures.get("compile_artifacts", {}).get("reason"),
        "regions": figures.get("regions"),
    }


def three_runs(name: str, command: list, cwd: Path, env: dict, scratch: Path) -> dict:
    """``command`` (after ``python``) with capture forced, first, second, second with inductor emptied."""
    env = {**env, "AUTOGAUDI_CACHE_DIR": str(scratch / f"{name}-cache"), "AUTOGAUDI_NO_CACHE": "0"}
    rows = {}
    inductor = None
    for run in RUNS:
        if run != "second":
            inductor = tempfile.mkdtemp(dir=scratch, prefix=f"{name}-inductor-")
        report = scratch / f"{name}-{len(rows)}.json"
        full = [sys.executable, "-m", "autogaudi", "--quiet", "--force", "graph_capture", "--report", str(report)]
        began, before = time.perf_counter(), load()
        done = subprocess.run(
            [*full, *command], cwd=cwd, env={**env, "TORCHINDUCTOR_CACHE_DIR": inductor}, capture_output=True, text=True
        )
        seconds = round(time.perf_counter() - began, 2)
        if done.returncode != 0:
            rows[run] = {"failed": done.returncode, "stderr": done.stderr[-2000:]}
            continue
        data = json.loads(report.read_text())
        rows[run] = {
            "seconds": seconds,
            "steps_per_s": data["steps"].get("steps_per_s"),
            "load_before": before,
            "load_after": load(),
            **capture_figures(data),
        }
    return rows


def workload(name: str, scratch: Path, corpus_folder: Path, quick: bool) -> dict:
    script = [str(HERE / "workloads" / WORKLOADS[name]), *(QUICK if quick else [])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGAUDI")}
    return three_runs(name, script, HERE / "workloads", env, scratch)


def corpus_case(name: str, scratch: Path, corpus_folder: Path, quick: bool) -> dict:
    (case,) = corpus.load_cases([corpus_folder], "cpu", [CORPUS_CASES[name]])
    if quick:
        case = corpus.shortened(case)
    copy = scratch / f"corpus-{name}"
    shutil.copytree(corpus_folder, copy, ignore=shutil.ignore_patterns("__pycache__"))
    env = corpus.clean_env(case, "capture forced")
    for command in case.get("setup", ()):  # as the corpus harness does
        subprocess.run([sys.executable, *command], cwd=copy / case["dir"], env=env, check=True, timeout=600)
    return three_runs(name, case["command"], copy / case["dir"], env, scratch)


def region_kinds(device: str) -> tuple:
    """The ways a region row trains: eagerly, and by each capture tier the device offers."""
    return ("eager", "whole", "regional", *(("replay",) if device == "cuda" else ()))


def regions(name: str, scratch: Path, corpus_folder: Path, quick: bool, device: str) -> dict:
    """Eager and each capture tier, each in a child process with an empty inductor folder."""
    rows = {}
    for kind in region_kinds(device):
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGAUDI")}
        env.update(TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(dir=scratch), AUTOGAUDI_NO_CACHE="1")
        command = [sys.executable, str(Path(__file__)), "--child", name, kind, str(corpus_folder), device]
        before = load()
        done = subprocess.run([*command, *(["--quick"] if quick else [])], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            rows[kind] = {"failed": done.returncode, "stderr": done.stderr[-2000:]}
            continue
        rows[kind] = {**json.loads(done.stdout.strip().splitlines()[-1]), "load_before": before, "load_after": load()}
    return rows


def gpt4(device: str):
    """A 4-layer nanoGPT-style GPT, 64 wide, 32 tokens, batch 8: (model, batch maker)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, width=64, heads=4):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attn, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
            self.heads = heads

        def forward(self, x):
            batch, tokens, width = x.shape
            q, k, v = (
                part.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2)
                for part in self.attn(self.ln1(x)).split(width, dim=2)
            )
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, tokens, width)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, layers=4, width=64, vocab=65, tokens=32):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(tokens, width)
            self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
            self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

        def forward(self, idx, targets):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
            for block in self.blocks:
                x = block(x)
            return F.cross_entropy(self.head(self.ln(x)).flatten(0, 1), targets.flatten())

    def batch():
        return torch.randint(0, 65, (8, 32), device=device), torch.randint(0, 65, (8, 32), device=device)

    return GPT(), batch, lambda output: output


def mingpt(corpus_folder: Path, device: str):
    """minGPT's GPT as chargpt builds it (gpt-nano, 65 characters, 128 tokens), batch 8."""
    import torch

    sys.path.insert(0, str(corpus_folder / "minGPT"))
    from mingpt.model import GPT

    config = GPT.get_default_config()
    config.model_type, config.vocab_size, config.block_size = "gpt-nano", 65, 128

    def batch():
        return torch.randint(0, 65, (8, 128), device=device), torch.randint(0, 65, (8, 128), device=device)

    return GPT(config), batch, lambda output: output[1]


REGION_MODELS = {"gpt4": lambda folder, device: gpt4(device), "mingpt": mingpt}


def child(name: str, kind: str, corpus_folder: Path, device: str, quick: bool) -> None:
    """Train ``name`` with capture forced as ``kind`` (or eagerly); print the figures as JSON."""
    import torch

    import autogaudi
    from autogaudi.measure import one_offs

    torch.manual_seed(0)
    model, batch, loss_of = REGION_MODELS[name](corpus_folder, device)
    model.to(device)
    if kind != "eager":  # pins the unit's choice: the tier asked for keeps the whole saving, the others none
        one_offs.REGIONAL_KEEPS = 1.0 if kind == "regional" else 1e-9
        one_offs.REPLAY_KEEPS = 1.0 if kind == "replay" else 1e-9
        if kind == "regional":  # measured even where the backend does not offer it (CUDA)
            from autogaudi.backends.cuda import CudaBackend

            CudaBackend.graphs_by_region = True
        autogaudi.enable(device=device, only="step_profiler,graph_capture", force="graph_capture", quiet=True)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for _ in range(40 if quick else 80):
        inputs, targets = batch()
        began = time.perf_counter()
        loss_of(model(inputs, targets)).backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize()
        times.append(time.perf_counter() - began)
    steady = times[-20:]  # after the profile (13 steps) and the compile
    figures = {"steady_ms_per_step": round(1000 * statistics.median(steady), 2)}
    if kind != "eager":
        row = autogaudi.report().unit("graph_capture")
        figures.update(capture_figures({"units": [row]}), status=row["reason_code"])
        figures["one_off_predicted_whole_s"] = row["figures"].get("one_off_predicted_whole_s")
        figures["one_off_predicted_regional_s"] = row["figures"].get("one_off_predicted_regional_s")
    print(json.dumps(figures))


PARTS = {
    **{name: workload for name in WORKLOADS},
    **{name: corpus_case for name in CORPUS_CASES},
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(argv[1], argv[2], Path(argv[3]), argv[4], "--quick" in argv)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=corpus.DEFAULT_CORPUS)
    parser.add_argument("--out", type=Path, default=HERE / "results" / f"one_offs-{suite.machine_name()}.json")
    parser.add_argument("--models", type=lambda t: [n for n in t.split(",") if n], default=list(PARTS))
    parser.add_argument("--regions", type=lambda t: [n for n in t.split(",") if n], default=list(REGION_MODELS))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the regions train")
    arguments = parser.parse_args(argv)
    unknown = sorted(set(arguments.models) - set(PARTS)) + sorted(set(arguments.regions) - set(REGION_MODELS))
    if unknown:
        parser.error(f"unknown: {', '.join(unknown)}; models: {', '.join(PARTS)}; regions: {', '.join(REGION_MODELS)}")
    results = json.loads(arguments.out.read_text()) if arguments.out.exists() else {}
    results.update(machine=suite.machine_name(), cores=os.cpu_count())
    results.setdefault("runs", {})
    results.setdefault("regions", {})
    scratch = Path(tempfile.mkdtemp(prefix="autogaudi-one-offs-"))
    try:
        for section, names, measure in (
            ("runs", arguments.models, lambda name: PARTS[name](name, scratch, arguments.corpus, arguments.quick)),
            (
                "regions",
                arguments.regions,
                lambda name: regions(name, scratch, arguments.corpus, arguments.quick, arguments.device),
            ),
        ):
            for name in names:
                results[section][name] = {"quick": arguments.quick, "date": time.strftime("%Y-%m-%d"), **measure(name)}
                arguments.out.parent.mkdir(parents=True, exist_ok=True)
                arguments.out.write_text(json.dumps(results, indent=1) + "\n")  # after each: a cut run keeps it
                arguments.out.with_suffix(".md").write_text(markdown(results))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(markdown(results))
    return 0


def _range(value) -> str:
    return f"{value[0]}-{value[1]}" if value else "-"


def markdown(results: dict) -> str:
    lines = [
        f"# Capture one-offs, {results['machine']}",
        "",
        "`python benchmarks/one_offs.py` (see its docstring and docs/benchmarks.md). One-off: graph_capture's "
        "set-up and first compile (`actual`, what the estimate predicts) and every part (`all parts`: with later "
        "compiles and the compile workers' shutdown). Load: the 1-minute load average before/after each run.",
        "",
        "## Runs: capture forced, first and second run",
        "",
        "| model | run | predicted (s) | range | actual (s) | all parts (s) | artifacts | whole run (s) | steps/s "
        "| load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.get("runs", {}).items():
        for run in RUNS:
            row = rows.get(run)
            if row is None:
                continue
            if "failed" in row:
                lines.append(f"| {name} | {run} | failed ({row['failed']}) | | | | | | | |")
                continue
            lines.append(
                f"| {name}{' (quick)' if rows.get('quick') else ''} | {run} | {row['one_off_predicted_s']} | "
                f"{_range(row['one_off_predicted_range_s'])} | {row['one_off_actual_s']} | {row['one_off_s']} | "
                f"{row['compile_artifacts']} ({row['artifacts_reason']}) | {row['seconds']} | {row['steps_per_s']} | "
                f"{row['load_before']}/{row['load_after']} |"
            )
    lines += [
        "",
        "## Regions: whole model against regional (and the replay tier on CUDA), empty inductor cache",
        "",
        "| model | capture | predicted (s) | actual (s) | steady ms/step | vs eager | load |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.get("regions", {}).items():
        eager = rows.get("eager", {}).get("steady_ms_per_step")
        for kind in ("eager", "whole", "regional", "replay"):
            row = rows.get(kind)
            if row is None and kind == "replay":
                continue
            if row is None or "failed" in row:
                lines.append(f"| {name} | {kind} | failed | | | | |")
                continue
            speed = f"{eager / row['steady_ms_per_step']:.2f}x" if eager else "-"
            lines.append(
                f"| {name}{' (quick)' if rows.get('quick') else ''} | {kind} | {row.get('one_off_predicted_s', '-')} | "
                f"{row.get('one_off_actual_s', '-')} | {row['steady_ms_per_step']} | {speed} | "
                f"{row['load_before']}/{row['load_after']} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
