"""The cache folder that runs and ranks share: remembered decisions and compile caches.

Why: every run used to start from nothing, profiling, trialling and compiling again (a capture's
one-off was 6-25 s for a small GPT-2 on an H100, 7.6-54 s of torch.compile on a 2-core CPU), while
users rerun the same script dozens of times. The folder (``~/.cache/autogaudi``, or
``$XDG_CACHE_HOME/autogaudi``; ``--cache-dir``; ``--no-cache`` for none) holds:

- ``decisions/<setup>/<entry>.json``: what a run decided (:mod:`autogaudi.memory`);
- ``compile/inductor``: torch.compile's caches (``TORCHINDUCTOR_CACHE_DIR``);
- ``compile/artifacts``: what ``torch.compiler.save_cache_artifacts`` gave after a capture compiled,
  keyed by script, model, inputs, torch and device (:mod:`autogaudi.one_offs`);
- ``one_offs``: the capture one-offs measured on each machine, with what was predicted for them;
- ``compile/hpu_recipes``: the Gaudi bridge's recipe cache (``PT_HPU_RECIPE_CACHE_CONFIG``).

Several processes write at once (the ranks of a job, the runs of a sweep): each write goes to a
temporary file in the entry's folder and is renamed over the entry, so a reader sees the old entry
or the new one, never half of one; eviction holds a lock on ``.lock`` (``fcntl.flock``), so only one
process evicts at a time. Eviction keeps the folder under its size limit by deleting the files
modified longest ago first, the policy of the Gaudi recipe cache. Nothing here imports torch: the
``cache`` command answers without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time

try:
    import fcntl
except ImportError:  # Windows: writes stay atomic; eviction is not serialised
    fcntl = None

DECISIONS = "decisions"
COMPILE = "compile"
LOCK = ".lock"
RECIPE_CACHE = "PT_HPU_RECIPE_CACHE_CONFIG"  # the Gaudi bridge's recipe disk cache, read when it loads


def default_root(environ=None) -> str:
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "autogaudi")


class Cache:
    """The folder at ``root``, kept under ``max_bytes``."""

    def __init__(self, root: str, max_bytes: int):
        self.root = os.path.abspath(root)
        self.max_bytes = max_bytes

    @classmethod
    def for_options(cls, options):
        """The cache the options ask for, or None (``--no-cache``)."""
        if options.no_cache:
            return None
        return cls(options.cache_dir or default_root(), options.cache_max_mb * 1024 * 1024)

    def folder(self, *parts: str) -> str:
        """A folder inside the cache, created on first use."""
        path = os.path.join(self.root, *parts)
        os.makedirs(path, exist_ok=True)
        return path

    @contextlib.contextmanager
    def locked(self):
        """Hold the cache's lock (one process at a time evicts or clears)."""
        with open(os.path.join(self.folder(), LOCK), "a") as handle:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                if fcntl is not None:
                    fcntl.flock(handle, fcntl.LOCK_UN)

    def write_json(self, path: str, value) -> None:
        """Write ``value`` to ``path`` (inside the cache) atomically, then evict what is over the limit."""
        self.write_bytes(path, json.dumps(value, indent=1, sort_keys=True).encode("utf-8"))

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (inside the cache) atomically, then evict what is over the limit."""
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=".writing-")
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(data)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        self.evict()

    def files(self) -> list:
        """(modified time, size, path) of every file in the cache but the lock."""
        found = []
        for folder, _dirs, names in os.walk(self.root):
            for name in names:
                path = os.path.join(folder, name)
                if path == os.path.join(self.root, LOCK):
                    continue
                with contextlib.suppress(OSError):  # another process evicted it meanwhile
                    stat = os.stat(path)
                    found.append((stat.st_mtime, stat.st_size, path))
        return found

    def size(self, *parts: str) -> int:
        """Bytes held under ``parts`` (the whole cache by default)."""
        prefix = os.path.join(self.root, *parts)
        return sum(size for _mtime, size, path in self.files() if path.startswith(prefix))

    def evict(self) -> list:
        """Delete the oldest files until the cache is under its limit; the paths deleted."""
        if not os.path.isdir(self.root):
            return []
        deleted = []
        with self.locked():
            files = sorted(self.files())
            total = sum(size for _mtime, size, _path in files)
            for _mtime, size, path in files:
                if total <= self.max_bytes:
                    break
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    deleted.append(path)
                total -= size
        return deleted

    def clear(self) -> None:
        """Delete everything the cache holds."""
        if not os.path.isdir(self.root):
            return
        with self.locked():
            for name in os.listdir(self.root):
                if name == LOCK:
                    continue
                path = os.path.join(self.root, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(path)

    def decisions(self) -> list:
        """(path, entry or None where unreadable) of every remembered decision, newest first."""
        root = os.path.join(self.root, DECISIONS)
        found = []
        for _mtime, _size, path in sorted(self.files(), reverse=True):
            if path.startswith(root + os.sep) and path.endswith(".json") and not os.path.basename(path).startswith("."):
                found.append((path, read_json(path)))
        return found


def read_json(path: str):
    """The JSON object in ``path``, or None when it is missing, unreadable or not an object."""
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _megabytes(size: int) -> str:
    return f"{size / 1024 / 1024:.1f} MB"


def listing(cache: Cache) -> str:
    """What ``python -m autogaudi cache list`` prints."""
    lines = [f"autogaudi cache: {cache.root} ({_megabytes(cache.size())} of {_megabytes(cache.max_bytes)})"]
    decisions = cache.decisions()
    lines.append(f"remembered decisions: {len(decisions)}")
    for path, entry in decisions:
        if entry is None:
            lines.append(f"  (unreadable, ignored by runs) {path}")
            continue
        profile = entry.get("profile", {})
        decided = [f"{profile.get('bound')}-bound (run {profile.get('run')})"] + [
            f"{name} {record.get('decision')} (run {record.get('run')})"
            for name, record in entry.get("trials", {}).items()
        ]
        lines.append(
            f"  {entry.get('script')} · {entry.get('model')} · {entry.get('backend')} {entry.get('device')} · "
            f"{'; '.join(decided)} · {entry.get('runs')} run(s), the last on {entry.get('last_run_on')}"
        )
    compile_root = os.path.join(cache.root, COMPILE)
    kinds = sorted(os.listdir(compile_root)) if os.path.isdir(compile_root) else []
    lines.append(
        "compile caches: " + (", ".join(f"{kind} {_megabytes(cache.size(COMPILE, kind))}" for kind in kinds) or "none")
    )
    return "\n".join(lines) + "\n"


def main(argv: list) -> int:
    """``python -m autogaudi cache {list,clear} [--cache-dir DIR]``."""
    import argparse

    from autogaudi.errors import OptionsError
    from autogaudi.options import Options

    parser = argparse.ArgumentParser(
        prog="python -m autogaudi cache",
        description="Show or clear what autogaudi remembers between runs.",
        allow_abbrev=False,
    )
    parser.add_argument("action", choices=("list", "clear"))
    parser.add_argument("--cache-dir", default=None, metavar="PATH", help="the cache folder (default: as runs use)")
    arguments = parser.parse_args(argv)
    try:
        options = Options.from_env().replace(
            no_cache=False, **({"cache_dir": arguments.cache_dir} if arguments.cache_dir else {})
        )
    except OptionsError as error:
        parser.error(str(error))
    cache = Cache.for_options(options)
    if arguments.action == "clear":
        before = cache.size()
        cache.clear()
        print(f"autogaudi cache: cleared {cache.root} ({_megabytes(before)})")
        return 0
    print(listing(cache), end="")
    return 0


def now() -> str:
    """The date and time entries are stamped with (local time, to the second)."""
    return time.strftime("%Y-%m-%d %H:%M:%S")


def compile_cache_environment(cache: Cache, bridge: bool) -> dict:
    """Where compilers keep their caches, inside ``cache``: torch.compile's (inductor: FX graphs,
    AOTAutograd, kernels) and, where the Gaudi bridge is installed, its recipe disk cache
    (``<dir>,<delete_on_start>,<max_MB>``: kept across runs, bounded by the cache's own limit)."""
    settings = {"TORCHINDUCTOR_CACHE_DIR": cache.folder(COMPILE, "inductor")}
    if bridge:
        recipes = cache.folder(COMPILE, "hpu_recipes")
        settings[RECIPE_CACHE] = f"{recipes},false,{cache.max_bytes // (1024 * 1024)}"
    return settings
