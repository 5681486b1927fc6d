"""Helpers shared by the tests: paths and a subprocess runner with a clean environment."""

import contextlib
import functools
import gc
import os
import subprocess
import sys
from pathlib import Path

from tests import prestarted

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SCRIPTS = TESTS / "scripts"
HPU_DOUBLE = TESTS / "hpu_double"


# Units that an option of their own switches on (off by default): the options that do, for generic tests.
SWITCHED_ON_BY = {"mixed_precision": {"precision": "bf16"}, "activation_checkpointing": {"memory_limit": 1e-4}}
# Units whose trial an option of their own asks for (the others: --trial UNIT).
TRIAL_BY = {"mixed_precision": {"precision": "auto"}}


def bare_report(**fields):
    """A Report of a CPU run with nothing in it but ``fields`` (trials, cache, ranks...)."""
    from autogaudi.reporting.record import Report

    empty = dict(
        torch_version="2.13.0",
        enabled_by=["enable"],
        active=True,
        backend={"name": "cpu", "device": "x86_64 CPU", "reason": "always available"},
        options={},
        steps={},
        memory=None,
        units=[],
    )
    return Report(**{**empty, **fields})


class GuardOwner:
    """What the core's guard and dispatcher see of a unit: in force until something of its raises,
    which it keeps (as text, as a unit does: the exception would keep its traceback's frames)
    instead of reverting anything."""

    def __init__(self):
        self.failures = []

    @property
    def in_force(self):
        return not self.failures

    def failed_at_run_time(self, error):
        self.failures.append(repr(error))


class SimulatedClock:
    """A clock that moves only when told: decisions taken on the times a test gives, with no sleeps
    and whatever else the machine runs (``autogaudi.measure.clock.now``, see the ``step_clock``
    fixture). With ``tick``, each reading moves it on by that much: every stretch timed from one
    reading to the next lasts one tick."""

    def __init__(self, tick: float = 0.0):
        self.now = 0.0
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def said(row, kind="note") -> list:
    """A report row's notes (``kind="recommendation"``: its recommendations) as (code, params) pairs:
    what tests assert, rather than the text."""
    if kind == "recommendation":  # objects with the exact change and what it could save
        return [(advice["code"], advice["params"]) for advice in row["recommendations"]]
    return list(zip(row[f"{kind}_codes"], row[f"{kind}_params"]))


def clean_env(**extra):
    """The environment of a plain run: no autogaudi settings inherited from whoever runs pytest, no
    cache folder (each run decides afresh; the cache's tests pass ``AUTOGAUDI_NO_CACHE=0``), and one
    intra-op thread, as torchrun gives each rank: the scripts' tensors are tiny, and two OpenMP
    threads per process on a loaded 2-core machine wait on each other at every op (minGPT's short
    run: 112 s with two, 10 s with one, on the same loaded machine). ``OMP_NUM_THREADS=...`` overrides."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("AUTOGAUDI") and k not in ("PT_HPU_LAZY_MODE", "HPU_DOUBLE_RELEASE")
    }
    env["OMP_NUM_THREADS"] = "1"
    env.pop("PYTHONPATH", None)
    # inductor writes its cache folder into the environment of a process that compiles
    # (torch/_inductor/runtime/cache_dir_utils.py): an in-process compile test would hand pytest's to every run.
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    env["AUTOGAUDI_NO_CACHE"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


# torch 2.13's gloo teardown sometimes aborts a worker after its work is done ("terminate called
# without an active exception", SIGABRT at exit): seen in 1 of 6 plain torchrun runs of ddp_train.py
# (autogaudi absent) and in accelerate's 2-process launch, and twice in a row once in a clean-clone CI
# run. Such a job is run again, up to twice more.
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def run_ranks(*args, **kwargs):
    """``run_python`` for a multi-process launch (torchrun, accelerate launch), run again (at most
    three runs) if and only if it ended in gloo's teardown abort; any other failure is returned as it is."""
    for _ in range(3):
        result = run_python(*args, **kwargs)
        if result.returncode == 0 or GLOO_TEARDOWN_ABORT not in result.stderr:
            break
    return result


def run_python(*args, env=None, cwd=None, timeout=180, fresh=False):
    """Run ``python *args`` and return the CompletedProcess (text mode). A run the pre-started
    interpreter cannot tell from a real one is forked from it (:mod:`tests.prestarted`); ``fresh=True``
    (tests of the interpreter's start, its imports or its timing) always starts a real one."""
    env = clean_env() if env is None else env
    if not fresh:
        forked = prestarted.run(args, env, cwd, timeout)
        if forked is not None:
            return forked
    return subprocess.run(
        [sys.executable, *map(str, args)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class ForkingRuns:
    """A harness module's ``subprocess`` in the suite (``module.subprocess = ForkingRuns()``): its
    ``python ...`` runs that the pre-started interpreter cannot tell from a real one (tests/prestarted_route.py's
    rule: a plain script, plain torch loading checkpoints, ``-m autogaudi``, this checkout or the double on
    PYTHONPATH) are forked from it, saving torch's import; every other run (a sitecustomize on PYTHONPATH,
    no environment given, other programs) starts as the harness starts it."""

    def __getattr__(self, name):
        return getattr(subprocess, name)

    @staticmethod
    def run(command, *, env=None, cwd=None, timeout=None, capture_output=False, text=False, **rest):
        if command[0] == sys.executable and env is not None and capture_output and text and not rest:
            forked = prestarted.run(command[1:], env, cwd, timeout)
            if forked is not None:
                return forked
        return subprocess.run(
            command, env=env, cwd=cwd, timeout=timeout, capture_output=capture_output, text=text, **rest
        )


@functools.cache
def plain_run(script, **env) -> subprocess.CompletedProcess:
    """``python script`` in a plain run's environment (``clean_env(**env)``), run once per test process
    however many tests, in whichever files, compare with it: a seeded script that writes nothing but its
    output runs plain the same for all of them. Not for scripts that write files or read the cache."""
    return run_python(script, env=clean_env(**env))


@contextlib.contextmanager
def collector_off():
    """The garbage collector off inside, and as it was after: what dies inside died by reference
    counting alone, as a script's objects die when it drops them."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@contextlib.contextmanager
def small_filesystem(where: Path, holding: Path = None, state: str = "full"):
    """A small tmpfs mounted at ``where``, holding a copy of ``holding`` (a folder) if given, then
    filled to the last byte (``state="full"``) or made read-only (``"read_only"``): what a run meets
    on a full or read-only disk. Needs root (the tests skip, saying so, elsewhere)."""
    import shutil

    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"could not mount a tmpfs: {mounted.stderr.decode().strip()}")
    try:
        if holding is not None:
            shutil.copytree(holding, where / holding.name, symlinks=True)
        if state == "full":
            with contextlib.suppress(OSError), open(where / "filler", "wb") as handle:
                while True:
                    handle.write(b"\0" * 4096)
                    handle.flush()
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def full_filesystem(where: Path):
    """:func:`small_filesystem`, empty and full."""
    return small_filesystem(where)


CORRUPTIONS = ("truncated", "garbage", "wrong_schema", "symlinked_out")
# and, where the test runs as root: the file replaced by one another user owns and anyone can write
OTHER_USER = "other_user"


def corrupt(path: Path, how: str, outside: Path, wrong=b'{"profile": "zzz"}') -> None:
    """Spoil a file autogaudi wrote in its cache: cut in half, random bytes, valid JSON that is not
    what autogaudi writes (``wrong``), a link to a copy of it outside the cache, or (``OTHER_USER``) a
    copy that another user owns and anyone can write."""
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(b"\x80\x04garbage" * 8)
    elif how == "wrong_schema":
        path.write_bytes(wrong)
    elif how == OTHER_USER:
        import pwd

        path.unlink()
        path.write_bytes(data)
        os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
        path.chmod(0o666)
    else:
        outside.mkdir(parents=True, exist_ok=True)
        target = outside / path.name
        target.write_bytes(data)
        path.unlink()
        path.symlink_to(target)
