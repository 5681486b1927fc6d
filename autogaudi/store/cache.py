"""The cache folder that runs and ranks share: remembered decisions and compile caches.

Why: every run used to start from nothing, profiling, trialling and compiling again (a capture's
one-off was 6-25 s for a small GPT-2 on an H100, 7.6-54 s of torch.compile on a 2-core CPU), while
users rerun the same script dozens of times. The folder (``~/.cache/autogaudi``, or
``$XDG_CACHE_HOME/autogaudi``; ``--cache-dir``; ``--no-cache`` for none) holds:

- ``decisions/<setup>/<entry>.json``: what a run decided (:mod:`autogaudi.store.decisions`);
- ``compile/inductor``: torch.compile's caches (``TORCHINDUCTOR_CACHE_DIR``);
- ``compile/artifacts``: what ``torch.compiler.save_cache_artifacts`` gave after a capture compiled,
  keyed by script, model, inputs, torch and device (:mod:`autogaudi.measure.one_offs`);
- ``one_offs``: the capture one-offs measured on each machine, with what was predicted for them;
- ``compile/hpu_recipes``: the Gaudi bridge's recipe cache (``PT_HPU_RECIPE_CACHE_CONFIG``).

Several processes write at once (the ranks of a job, the runs of a sweep): each write goes to a
temporary file in the entry's folder and is renamed over the entry, so a reader sees the old entry
or the new one, never half of one; eviction holds a lock on ``.lock`` (``fcntl.flock``), so only one
process evicts at a time. Eviction keeps the folder under its size limit by deleting the files
modified longest ago first, the policy of the Gaudi recipe cache. Nothing here imports torch: the
``cache`` command answers without it.

The cache owns only what it wrote: its root carries a ``CACHEDIR.TAG`` naming autogaudi, and
eviction and ``cache clear`` touch only plain files under the folders above, never a link's target,
never a root without that tag (a folder holding other files and no tag, or another tool's tag, is
refused as a cache: :meth:`Cache.refusal`). What it loads can run code (compiled artifacts are
pickles), so a cache another user owns or could swap is neither read nor written unless the user
says ``--cache-trust-shared`` (:mod:`autogaudi.store.trust`), checked at every read and write, and
an artifact loads only where its sha256 is the one recorded when it was saved. Entries are checked
against :data:`autogaudi.store.schemas.SCHEMAS` when read: one that does not match is dropped with a note.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import sys
import tempfile
import time

from autogaudi.core.reasons import Reason
from autogaudi.entry.paths import NoCacheFolder, default_root
from autogaudi.store.schemas import SCHEMAS, problem
from autogaudi.store.trust import distrust, distrust_above, inductor_cache_distrust  # noqa: F401 (theirs too)

try:
    import fcntl
except ImportError:  # Windows: writes stay atomic; eviction is not serialised
    fcntl = None

DECISIONS = "decisions"
COMPILE = "compile"
ONE_OFFS = "one_offs"
LAYOUT = (DECISIONS, COMPILE, ONE_OFFS)  # the only folders eviction and clear ever look into
LOCK = ".lock"
TAG = "CACHEDIR.TAG"  # https://bford.info/cachedir/: marks the folder as autogaudi's (backup tools skip it too)
TAG_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"  # every tool's tag starts so (cargo's, pytest's)
TAG_OWNER = "# This file is a cache directory tag created by autogaudi:"  # the next line: only autogaudi's
TAG_TEXT = (
    f"{TAG_SIGNATURE}\n{TAG_OWNER} every file under decisions/,\n"
    "# compile/ and one_offs/ here is autogaudi's. See https://bford.info/cachedir/\n"
)
OWN = (*LAYOUT, LOCK, TAG)  # what an autogaudi cache holds at its root
RECIPE_CACHE = "PT_HPU_RECIPE_CACHE_CONFIG"  # the Gaudi bridge's recipe disk cache, read when it loads
FOLDER_MODE = 0o700
WRITING = ".writing-"  # a write in progress (write_atomically's temporary), renamed over its target when done
# A temporary older than this is a killed process's leftover, evicted like any file; a younger one is
# another process's write in progress, which eviction must not pull from under it.
WRITING_STALE_S = 3600
TRUST_FLAG = "--cache-trust-shared"

# What the report's cache notes can say: code -> text (the codes are what scripts and tests read).
NOTES = {
    "cache_refused": "cache not used: {why}",
    "cache_untrusted": "cache not used: {why}; nothing is read from it (a folder another user can write "
    "can make this run execute their code). Choose a folder of your own, or pass " + TRUST_FLAG,
    "cache_not_used": "cache not used: {error!r}",
    "compile_cache_untrusted": "torch.compile's cache ({variable}): {why}; torch loads compiled code from there",
    "recipe_cache_not_set": "{variable} not set: the Gaudi bridge was loaded before autogaudi started",
    "decisions_not_remembered": "decisions are not remembered: {error!r}",
    "decisions_not_written": "could not write the decisions: {error!r}",
    "not_evicted": "could not evict: {error!r}",
    "entry_unreadable": "ignored a cache entry that could not be read: {path}",
    "entry_other_setup": "ignored a cache entry written for another set-up (format {format}, autogaudi {version}): "
    "{path}",
    "entry_invalid": "ignored a cache entry that does not hold what autogaudi writes ({problem}): {path}",
}


def note(code: str, **params) -> Reason:
    """One of the cache's notes (:data:`NOTES`), as the report carries it: code, text and values."""
    return Reason(code, NOTES, **params)


def tag_owner(root: str):
    """Who tagged ``root``: "autogaudi" (its ``CACHEDIR.TAG``: the signature, then autogaudi's own
    line), the tag's second line where another tool's tag is there, or None (no tag, a link, or a
    file that does not start with the signature: not a tag)."""
    try:
        with open(os.path.join(root, TAG), "rb", opener=_no_follow) as handle:
            lines = handle.read(512).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    if not lines or lines[0].rstrip() != TAG_SIGNATURE:
        return None
    if len(lines) > 1 and lines[1].startswith(TAG_OWNER):
        return "autogaudi"
    return lines[1].strip() if len(lines) > 1 and lines[1].strip() else "no line naming its tool"


def _has_tag(root: str) -> bool:
    """Whether ``root`` carries autogaudi's own ``CACHEDIR.TAG`` (a plain file, not a link)."""
    return tag_owner(root) == "autogaudi"


def _no_follow(path, flags):
    """An ``open()`` opener that refuses a link at ``path``; what it creates only this user can read."""
    return os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o600)


class Cache:
    """The folder at ``root``, kept under ``max_bytes``: autogaudi's own files only (:data:`LAYOUT`),
    under a root that carries :data:`TAG`."""

    def __init__(self, root: str, max_bytes: int, trust_shared: bool = False):
        self.root = os.path.abspath(root)
        self.max_bytes = max_bytes
        self.trust_shared = trust_shared
        self.notes: list = []  # what readers dropped (invalid entries), for the report
        self._claimed = False

    @classmethod
    def for_options(cls, options):
        """The cache the options ask for, or None (``--no-cache``)."""
        if options.no_cache:
            return None
        return cls(options.cache_dir or default_root(), options.cache_max_mb * 1024 * 1024, options.cache_trust_shared)

    def refusal(self):
        """Why ``root`` cannot be autogaudi's cache, or None: it is not a folder, or it holds files
        autogaudi did not write and no tag (a project folder, ``~/.cache`` itself). Evicting there
        would delete the user's files."""
        if not os.path.lexists(self.root):
            return None
        if not os.path.isdir(self.root):
            return f"the cache folder {self.root} is not a folder. {self._choose()}"
        owner = tag_owner(self.root)
        if owner == "autogaudi":
            return None
        if owner is not None:
            return (
                f"the cache folder {self.root} carries another tool's {TAG} ({owner}): it is that tool's cache, "
                f"and autogaudi would delete its files. {self._choose()}"
            )
        try:
            # a write in progress is another process's tag on its way (two runs claiming one new folder)
            others = sorted(name for name in os.listdir(self.root) if name not in OWN and not name.startswith(WRITING))
        except OSError as error:
            return f"the cache folder {self.root} cannot be listed ({error.strerror}). {self._choose()}"
        if not others:  # empty, or an earlier autogaudi's cache (before the tag)
            return None
        shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        return (
            f"the cache folder {self.root} holds files autogaudi did not write ({shown}) and no {TAG}; "
            f"autogaudi would delete them to keep the cache under its size limit. {self._choose()}"
        )

    @staticmethod
    def _choose() -> str:
        try:
            default = f"the default ({default_root()})"
        except NoCacheFolder:
            default = "the default (none here: no home folder)"
        return (
            f"Choose an empty or new folder with --cache-dir (AUTOGAUDI_CACHE_DIR), leave it unset for {default}, "
            "or pass --no-cache"
        )

    def distrust(self):
        """Why this cache could hold another user's code, or None (``--cache-trust-shared``: never):
        its root or a folder of its layout is another user's or writable by others, or a folder above
        it would let another user swap it (:mod:`autogaudi.store.trust`)."""
        if self.trust_shared:
            return None
        levels = [self.root] + [os.path.join(self.root, *parts) for parts in TRUSTED_LEVELS]
        for level in levels:
            why = distrust(level, follow=level == self.root)
            if why:
                return why
        return distrust_above(self.root)

    def trusted(self) -> bool:
        """Whether the cache is still this user's, checked again before every read and write: a
        folder swapped in the middle of a run is neither read nor written. Where not, the notes say why."""
        why = self.distrust()
        if why is not None:
            self.note("cache_untrusted", why=why)
        return why is None

    def _check_trusted(self) -> None:
        if not self.trusted():
            raise PermissionError(f"the cache {self.root} is no longer this user's alone: {self.distrust()}")

    def claim(self) -> None:
        """Make ``root`` the cache (created, mode 0o700, tagged), unless it is refused or not
        trusted (OSError): nothing is written, not even the tag, before both are checked."""
        if self._claimed:
            return
        refused = self.refusal()
        if refused:
            raise PermissionError(refused)
        self._check_trusted()
        parent = os.path.dirname(self.root)
        os.makedirs(parent, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.root, FOLDER_MODE)
        self._check_trusted()  # what was there already, or what another user made first
        if not _has_tag(self.root):
            write_atomically(os.path.join(self.root, TAG), TAG_TEXT.encode())
        self._claimed = True

    def folder(self, *parts: str) -> str:
        """A folder inside the cache, each level created on first use with mode 0o700."""
        self.claim()
        path = self.root
        for part in parts:
            path = os.path.join(path, part)
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, FOLDER_MODE)
        return path

    @contextlib.contextmanager
    def locked(self):
        """Hold the cache's lock (one process at a time evicts or clears). A link or anything but a
        plain file where the lock belongs is taken away (never what it points to), so one planted
        link does not leave every later run unable to evict."""
        path = os.path.join(self.root, LOCK)
        found = os.lstat(path) if os.path.lexists(path) else None
        if found is not None and not stat.S_ISREG(found.st_mode):
            os.unlink(path)
        with open(path, "a", opener=_no_follow) as handle:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                if fcntl is not None:
                    fcntl.flock(handle, fcntl.LOCK_UN)

    def note(self, code: str, **params) -> None:
        """Say something in the report's cache notes, once however often it is found."""
        said = note(code, **params)
        if all(str(earlier) != str(said) for earlier in self.notes):
            self.notes.append(said)

    def write_json(self, path: str, value) -> None:
        """Write ``value`` to ``path`` (inside the cache) atomically, then evict what is over the limit."""
        self.write_bytes(path, json.dumps(value, indent=1, sort_keys=True).encode("utf-8"))

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path`` (inside the cache's layout) atomically, then evict what is over the limit."""
        inside = os.path.relpath(os.path.dirname(os.path.abspath(path)), self.root)
        if inside.split(os.sep)[0] not in LAYOUT:
            raise ValueError(f"{path} is outside the cache's layout ({', '.join(LAYOUT)})")
        self._check_trusted()
        write_atomically(path, data, self.folder(*inside.split(os.sep)))
        self.evict()

    def files(self) -> list:
        """(modified time, size, path) of every plain file in the cache's layout; links are not followed."""
        found = []
        for name in LAYOUT:
            top = os.path.join(self.root, name)
            if os.path.islink(top):
                continue
            for folder, _dirs, names in os.walk(top):  # os.walk lists linked folders but does not enter them
                for name in names:
                    path = os.path.join(folder, name)
                    with contextlib.suppress(OSError):  # another process evicted it meanwhile
                        found_stat = os.lstat(path)
                        if stat.S_ISREG(found_stat.st_mode):
                            found.append((found_stat.st_mtime, found_stat.st_size, path))
        return found

    def size(self, *parts: str) -> int:
        """Bytes held under ``parts`` (the whole cache by default)."""
        prefix = os.path.join(self.root, *parts)
        return sum(size for _mtime, size, path in self.files() if path.startswith(prefix))

    def evict(self) -> list:
        """Delete the oldest files of the layout until the cache is under its limit; the paths
        deleted. Nothing without autogaudi's tag, or where not trusted: the folder may not be autogaudi's."""
        if not _has_tag(self.root) or not self.trusted():
            return []
        deleted = []
        stale = time.time() - WRITING_STALE_S
        with self.locked():
            files = sorted(
                (mtime, size, path)
                for mtime, size, path in self.files()
                if not (os.path.basename(path).startswith(WRITING) and mtime > stale)
            )
            total = sum(size for _mtime, size, _path in files)
            for _mtime, size, path in files:
                if total <= self.max_bytes:
                    break
                with contextlib.suppress(OSError):
                    os.unlink(path)
                    deleted.append(path)
                total -= size
        return deleted

    def clear(self) -> bool:
        """Delete everything in the cache's layout; False (nothing deleted) without autogaudi's tag."""
        if not _has_tag(self.root):
            return False
        with self.locked():
            for name in LAYOUT:
                path = os.path.join(self.root, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path, ignore_errors=True)  # removes links inside, never what they point to
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
        return True

    def decisions(self) -> list:
        """(path, entry or None where unreadable) of every remembered decision, newest first."""
        root = os.path.join(self.root, DECISIONS)
        found = []
        for _mtime, _size, path in sorted(self.files(), reverse=True):
            if path.startswith(root + os.sep) and path.endswith(".json") and not os.path.basename(path).startswith("."):
                found.append((path, read_json(path)))
        return found


# The folders of the layout whose owner and mode the trust rule checks (besides the root).
TRUSTED_LEVELS = ((DECISIONS,), (COMPILE,), (COMPILE, "artifacts"), (COMPILE, "inductor"), (ONE_OFFS,))


def write_atomically(path: str, data: bytes, folder: str | None = None, before_replace=None) -> None:
    """Write ``data`` to a temporary file beside ``path`` and rename it over ``path``: a reader sees
    the old file or the new one, never half of one. ``before_replace(temporary)`` may check or
    finish the temporary file first (what raises there leaves ``path`` as it was)."""
    descriptor, temporary = tempfile.mkstemp(dir=folder or os.path.dirname(path), prefix=WRITING)
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        if before_replace is not None:
            before_replace(temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def refusal(options):
    """Why the cache the options name cannot be used, or None (``--no-cache``, or it can): what the
    launcher says before the script starts, exiting 2. No home folder for the default is not one:
    the run goes on without a cache, and its report says why."""
    try:
        cache = Cache.for_options(options)
    except NoCacheFolder:
        return None
    return None if cache is None else cache.refusal()


def read_bytes(path: str) -> bytes:
    """The bytes of a plain file of the cache (a link at ``path`` is refused: OSError)."""
    with open(path, "rb", opener=_no_follow) as handle:
        return handle.read()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_json(path: str):
    """The JSON object in ``path``, or None when it is missing, unreadable, a link or not an object."""
    try:
        value = json.loads(read_bytes(path).decode("utf-8"))
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
        invalid = problem(entry, SCHEMAS["decisions"])
        if invalid:
            lines.append(f"  (not what autogaudi writes: {invalid}; ignored by runs) {path}")
            continue
        profile = entry["profile"]
        decided = [f"{profile.get('bound')}-bound (run {profile.get('run')})"] + [
            f"{name} {record.get('decision')} (run {record.get('run')})" for name, record in entry["trials"].items()
        ]
        lines.append(
            f"  {entry.get('script')} · {entry.get('model')} · {entry.get('backend')} {entry.get('device')} · "
            f"{'; '.join(decided)} · {entry.get('runs')} run(s), the last on {entry.get('last_run_on')}"
        )
    compile_root = os.path.join(cache.root, COMPILE)
    is_folder = os.path.isdir(compile_root) and not os.path.islink(compile_root)
    kinds = sorted(os.listdir(compile_root)) if is_folder else []
    lines.append(
        "compile caches: " + (", ".join(f"{kind} {_megabytes(cache.size(COMPILE, kind))}" for kind in kinds) or "none")
    )
    return "\n".join(lines) + "\n"


def main(argv: list) -> int:
    """``python -m autogaudi cache {list,clear} [--cache-dir DIR]``: 2 where the folder is not
    autogaudi's (no tag; for ``list``, files autogaudi did not write), having deleted nothing."""
    import argparse

    from autogaudi.core.errors import OptionsError
    from autogaudi.core.options import Options

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
    try:
        cache = Cache.for_options(options)
    except NoCacheFolder as error:
        parser.error(str(error))
    refused = cache.refusal()
    if refused:
        sys.stderr.write(f"autogaudi cache: {refused}\n")
        return 2
    if arguments.action == "clear":
        if not os.path.lexists(cache.root):
            print(f"autogaudi cache: nothing to clear at {cache.root}")
            return 0
        before = cache.size()
        if not cache.clear():
            sys.stderr.write(
                f"autogaudi cache: deleted nothing: {cache.root} carries no {TAG} of autogaudi's, so autogaudi "
                "cannot tell its files from others'; a run with this --cache-dir tags it, or delete the folder "
                "yourself\n"
            )
            return 2
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
