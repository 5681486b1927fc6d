"""Compiling aside: what a forked child compiling the model costs the eager steps meanwhile.

    python benchmarks/compile_aside.py [--model gpt4|mingpt] [--steps 120] [--rounds 2] [--threads N]
        [--modes eager,sync,aside,aside-yield] [--windows SECONDS] [--corpus ../shared/corpus] [--out FILE]

Whole runs: each round runs ``--modes`` in that order, each in a fresh process with an empty inductor
folder (``TORCHINDUCTOR_CACHE_DIR``), training the same model for ``--steps`` steps (at ``--threads``
torch threads, default torch's) with the CPU backend's ``graph_forward`` (the call graph_capture
compiles through):

- *eager*: no compile;
- *sync*: compiled in the step after the warm-up (as graph_capture does);
- *aside*: after the warm-up a forked child (stdout/stderr to /dev/null, one torch thread, inductor
  compiling in-process) compiles the same model on the same inputs, forward and backward, filling
  inductor's on-disk caches, while the parent trains eagerly and polls it with ``waitpid(WNOHANG)``
  at each step; once it is done the parent compiles (its caches now warm) and trains compiled;
- *aside-yield*: as *aside*, the parent at one torch thread fewer while the child compiles.

``--windows SECONDS``: instead, in one process, eager steps in alternating windows of that length,
at torch's threads and at one fewer, each alone and beside a child compiling the model over and
over (caches off): the median step of each window.

Figures: the eager step time before (median), during the child's compile (median) and their ratio;
the child's wall time; the parent's compile (sync: cold, aside: warm); the steady compiled step;
the whole run's wall clock; the 1-minute load average before and after each run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

WARM_UP = 10


def load() -> float:
    return round(os.getloadavg()[0], 2)


def _quiet_single_threaded_child() -> None:
    """A forked child's set-up: its output to /dev/null, one torch thread, inductor compiling in-process."""
    import torch
    import torch._inductor.config as inductor_config

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    torch.set_num_threads(1)
    inductor_config.compile_threads = 1


def child_compile(backend, model, inputs, loss_of) -> None:
    """In the forked child: compile forward and backward into inductor's caches, leave with _exit."""

    status = 1
    try:
        _quiet_single_threaded_child()
        compiled = backend.graph_forward(model)
        loss_of(compiled(*inputs)).backward()
        status = 0
    finally:
        os._exit(status)


def busy_compiler(backend, model, inputs, loss_of) -> int:
    """Fork a child that compiles ``model`` over and over (caches off) until killed: a compile's load."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        import torch

        try:
            import torch._dynamo
            import torch._inductor.config as inductor_config

            _quiet_single_threaded_child()
            inductor_config.force_disable_caches = True
            while True:
                torch._dynamo.reset()
                loss_of(backend.graph_forward(model)(*inputs)).backward()
        finally:
            os._exit(1)
    return pid


def windows(name: str, seconds: float, rounds: int, corpus_folder: Path) -> list:
    """Eager steps in alternating windows: at the script's threads and at one fewer, each alone
    and beside a child compiling; the median step of each window, with the load average."""
    import one_offs as bench
    import torch

    from autogaudi.backends.cpu import probe

    torch.manual_seed(0)
    model, batch, loss_of = bench.REGION_MODELS[name](corpus_folder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backend, threads = probe(), torch.get_num_threads()
    rows = []
    for _ in range(rounds):
        for window_threads in (threads, max(1, threads - 1)):
            for beside in (False, True):
                torch.set_num_threads(window_threads)
                pid = busy_compiler(backend, model, batch(), loss_of) if beside else None
                times, before, ends = [], load(), time.perf_counter() + seconds
                while time.perf_counter() < ends:
                    inputs = batch()
                    started = time.perf_counter()
                    loss_of(model(*inputs)).backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    times.append(time.perf_counter() - started)
                if pid is not None:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                row = {"threads": window_threads, "child_compiling": beside, "steps": len(times)}
                row.update(ms=round(1000 * statistics.median(times[2:]), 2), load_before=before, load_after=load())
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def train(name: str, mode: str, steps: int, corpus_folder: Path, threads: int | None) -> dict:
    import one_offs as bench
    import torch

    from autogaudi.backends.cpu import probe

    torch.manual_seed(0)
    if threads:
        torch.set_num_threads(threads)
    model, batch, loss_of = bench.REGION_MODELS[name](corpus_folder)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    backend = probe()
    call, pid, child_began = model, None, None
    figures: dict = {"mode": mode, "threads": torch.get_num_threads(), "load_before": load()}
    times, during = [], []
    began_run = time.perf_counter()
    for step in range(steps):
        inputs = batch()
        if step == WARM_UP and mode.startswith("aside"):
            sys.stdout.flush()
            sys.stderr.flush()
            child_began = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                child_compile(backend, model, inputs, loss_of)
            if mode == "aside-yield":  # the parent leaves the child a core meanwhile
                torch.set_num_threads(max(1, figures["threads"] - 1))
        if pid is not None:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                figures["child_s"] = round(time.perf_counter() - child_began, 3)
                figures["child_status"] = status
                figures["child_done_at_step"] = step
                pid = None
                call = "compile"
                torch.set_num_threads(figures["threads"])
        if (step == WARM_UP and mode == "sync") or call == "compile":
            started = time.perf_counter()
            call = backend.graph_forward(model)
            loss_of(call(*inputs)).backward()
            optimizer.step()
            optimizer.zero_grad()
            figures["parent_compile_s"] = round(time.perf_counter() - started, 3)
            figures["compiled_at_step"] = step
            continue
        started = time.perf_counter()
        loss_of(call(*inputs)).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds = time.perf_counter() - started
        (during if pid is not None else times).append((step, seconds))
    if pid is not None:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        figures["child_unfinished"] = True
    figures["whole_run_s"] = round(time.perf_counter() - began_run, 3)
    before = [s for step, s in times if step < WARM_UP and step >= 2]
    figures["eager_ms"] = round(1000 * statistics.median(before), 2)
    if during:
        figures["eager_during_child_ms"] = round(1000 * statistics.median(s for _, s in during), 2)
        figures["during_steps"] = len(during)
        figures["slowdown"] = round(figures["eager_during_child_ms"] / figures["eager_ms"], 2)
        figures["child_cost_s"] = round(sum(s for _, s in during) - len(during) * figures["eager_ms"] / 1000, 3)
    after = [s for step, s in times if step > figures.get("compiled_at_step", steps) + 2]
    if after:
        figures["compiled_ms"] = round(1000 * statistics.median(after), 2)
    figures["load_after"] = load()
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt4")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--corpus", default=str(HERE.parent.parent.parent / "shared" / "corpus"))
    parser.add_argument("--out")
    parser.add_argument("--threads", type=int, help="the training process's torch threads (default: torch's)")
    parser.add_argument("--modes", default="eager,sync,aside,aside-yield")
    parser.add_argument("--windows", type=float, help="seconds per window: the alternating-windows experiment")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.windows:
        rows = windows(args.model, args.windows, args.rounds, Path(args.corpus))
        if args.out:
            Path(args.out).write_text(json.dumps({"model": args.model, "windows": rows}, indent=1))
        return 0
    if args.child:
        print(json.dumps(train(args.model, args.child[0], args.steps, Path(args.corpus), args.threads)))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.rounds):
            for mode in args.modes.split(","):
                env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGAUDI")}
                env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(dir=scratch)
                command = [sys.executable, __file__, "--model", args.model, "--steps", str(args.steps)]
                command += ["--corpus", args.corpus, "--child", mode, "-"]
                command += ["--threads", str(args.threads)] if args.threads else []
                done = subprocess.run(command, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    rows.append({"mode": mode, "failed": done.returncode, "stderr": done.stderr[-2000:]})
                else:
                    rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(json.dumps({"model": args.model, **rows[-1]}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "steps": args.steps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
