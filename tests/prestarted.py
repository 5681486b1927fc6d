"""A pre-started interpreter for the tests' script runs: ``python *args`` without paying ``import torch``.

Why: the slow lane starts hundreds of interpreters, most of whose CPU time is torch's import (and
Dynamo's, at a script's first optimizer). A server per fingerprint of the import-time environment,
started lazily once per test process, imports them once and forks a child per run, set up as a fresh
``python *args`` is: argv, sys.path, ``__main__``, environment, cwd, stdio, signal dispositions, and
the exit (SystemExit, traceback and 1, KeyboardInterrupt as SIGINT, threads and atexit at the end).
torch is out of ``sys.modules`` in the child until its script imports it (:class:`_Preloaded`), so
autogaudi's launcher still sees the script's own ``import torch`` begin and end.
multiprocessing's forkserver was not used: its children end in ``os._exit`` without atexit handlers.

Only a run the fork cannot tell apart is routed here (:func:`tests.prestarted_route.route`): no
interpreter flags, no ``AUTOGAUDI`` (read at interpreter start), ``-m autogaudi``, or a script (``-c``
code, a ``-m`` module in the cwd or on PYTHONPATH) that names torch and not ``gc``, with no
usercustomize on PYTHONPATH (a sitecustomize there the child imports as ``site`` does). The server
imports torch with no device backend; a run's own import of torch loads its backend (the HPU
double's, from PYTHONPATH) as torch's import ends.
Everything else, and ``fresh=True``, gets a real interpreter.

Known differences a script could see: the server's frames below ``<module>``, ``os.getppid()``, a
process group and session of its own, one hash seed per server, the modules torch imports that are
not torch's (numpy, ...) already imported, torch's import taking no time, and the server's objects
frozen out of the collector's view (``gc.freeze``). The server exits when the test process's end of
its socket closes. ``TESTS_PRESTARTED=0`` in the tests' environment gives every run a real one.
"""

import gc
import io
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

MAX_SERVERS = 3  # per test process; a fingerprint beyond them gets real interpreters
MESSAGE = 1 << 20


class _Server:
    """One pre-started interpreter: a SEQPACKET socket to it, one request (and its own socket) a run."""

    def __init__(self, env: dict):
        self.owner = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server_env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        starter = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=server_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a ^C to the test run is the tests', not the server's
        )
        theirs.close()
        starter.wait()  # it forks the server and exits: no child of the test process left behind
        self.control = ours
        ours.settimeout(300)
        ready = ours.recv(64).split()  # after its imports; an empty read: it died
        ours.settimeout(None)
        self.pid = int(ready[1]) if ready[:1] == [b"ready"] else None

    def close(self):
        self.control.close()  # the server sees the end of its socket and exits

    def run(self, args: list, env: dict, cwd, timeout):
        """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)``, forked."""
        command = [sys.executable, *args]
        request, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        where = os.path.abspath(cwd) if cwd is not None else os.getcwd()
        message = json.dumps({"args": args, "env": env, "cwd": where}).encode()
        try:
            socket.send_fds(self.control, [message], [theirs.fileno(), 0, out_w, err_w])
        finally:
            for fd in (out_w, err_w):
                os.close(fd)
            theirs.close()
        outputs = {out_r: [], err_r: []}
        status, pid = None, None
        with selectors.DefaultSelector() as selector:
            for fd in outputs:
                selector.register(fd, selectors.EVENT_READ)
            selector.register(request, selectors.EVENT_READ)
            deadline = None if timeout is None else time.monotonic() + timeout
            while selector.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    _kill(pid)
                    self._finish(request, selector, outputs)
                    out, err = (b"".join(outputs[fd]) for fd in (out_r, err_r))
                    raise subprocess.TimeoutExpired(command, timeout, out, err)
                for key, _ in selector.select(left):
                    if key.fileobj is request:
                        reply = request.recv(MESSAGE)
                        if not reply:
                            selector.unregister(request)
                            continue
                        said = json.loads(reply)
                        pid, status = said.get("pid", pid), said.get("status", status)
                        continue
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        outputs[key.fd].append(chunk)
                    else:
                        selector.unregister(key.fd)
        for fd in outputs:
            os.close(fd)
        request.close()
        if status is None:
            raise RuntimeError(f"the pre-started interpreter lost the run of {command}")
        return subprocess.CompletedProcess(
            command, os.waitstatus_to_exitcode(status), _text(b"".join(outputs[out_r])), _text(b"".join(outputs[err_r]))
        )

    @staticmethod
    def _finish(request, selector, outputs):
        """After the kill: the status (the server reaps it) and the pipes closed, as subprocess.run waits."""
        for key in list(selector.get_map().values()):
            selector.unregister(key.fileobj)
        request.settimeout(30)
        try:
            while request.recv(MESSAGE):
                pass
        except OSError:
            pass
        request.close()
        for fd in outputs:
            os.close(fd)


def _kill(pid) -> None:
    """The child and its process group, as a timeout of subprocess.run kills the child."""
    for kill in (os.killpg, os.kill) if pid is not None else ():
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _text(data: bytes) -> str:
    """As subprocess decodes a text-mode pipe: the locale's encoding, universal newlines."""
    wrapper = io.TextIOWrapper(io.BytesIO())
    return data.decode(wrapper.encoding, wrapper.errors).replace("\r\n", "\n").replace("\r", "\n")


_SERVERS: dict = {}
_LOCK = threading.Lock()


def run(args: list, env: dict, cwd, timeout):
    """The run's CompletedProcess, or None where it needs a real interpreter (:func:`tests.prestarted_route.route`)."""
    from tests.prestarted_route import fingerprint, route  # the server itself starts without the tests' package

    args = [str(a) for a in args]
    if os.environ.get("TESTS_PRESTARTED") == "0" or route(args, env, cwd) is not None:
        return None
    key = fingerprint(env)
    with _LOCK:
        server = _SERVERS.get(key)
        if server is not None and server.owner != os.getpid():  # a fork of the test process
            return None
        if server is None:
            if len(_SERVERS) >= MAX_SERVERS:
                return None
            server = _SERVERS[key] = _Server(env)
    if server.pid is None:
        return None
    return server.run(args, env, cwd, timeout)


def close_all() -> None:
    with _LOCK:
        for server in _SERVERS.values():
            if server.owner == os.getpid():
                server.close()
        _SERVERS.clear()


_BASE_PATH = sys.path[1:]  # the server's own start, less its folder: every run's sys.path after its own entries
_SERVER_SIGNALS = (signal.SIGCHLD,)


def _serve(control_fd: int):
    """Import, then fork a child per request until the test process goes; returns in a child only.
    The server itself is a fork whose parent exits at once: a test that counts its own children sees none."""
    if os.fork():
        os._exit(0)
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # each run's torch import loads its own device backend
    _PRELOADED.append(_preload("torch"))
    _PRELOADED.append(_preload("torch._dynamo"))  # a plain script's first optimizer imports it

    control = socket.socket(fileno=control_fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    gc.freeze()  # each child's exit then leaves the server's objects alone: no page copied to collect them
    control.send(b"ready %d" % os.getpid())
    waiting = {}  # pid -> the request's socket, told the status at the end
    with selectors.DefaultSelector() as selector:
        selector.register(control, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is control:
                    message, fds, _, _ = socket.recv_fds(control, MESSAGE, 4)
                    if not message:
                        sys.exit(0)
                    request = socket.socket(fileno=fds[0])
                    pid = os.fork()
                    if pid == 0:
                        for other in (control, *waiting.values()):
                            other.close()
                        request.close()
                        for fd in (wake_r, wake_w):
                            os.close(fd)
                        signal.set_wakeup_fd(-1)
                        for number in _SERVER_SIGNALS:
                            signal.signal(number, signal.SIG_DFL)
                        return json.loads(message), fds[1:]
                    for fd in fds[1:]:
                        os.close(fd)
                    request.send(json.dumps({"pid": pid}).encode())
                    waiting[pid] = request
                else:
                    os.read(wake_r, 4096)
                    _reap(waiting)


def _reap(waiting: dict) -> None:
    while waiting:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        request = waiting.pop(pid, None)
        if request is not None:
            try:
                request.send(json.dumps({"status": status}).encode())
            except OSError:
                pass
            request.close()


def _become(request: dict, stdio: list):
    """This child set up as ``python *args`` starts; returns what to run: ("module", name) or (code, globals)."""
    import builtins
    import importlib
    import importlib.machinery
    import linecache
    import tempfile
    import types

    os.setpgid(0, 0)  # the timeout kills the group
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    args = request["args"]
    entries = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    tail = list(dict.fromkeys(os.path.abspath(p) for p in entries))
    tail += [p for p in _BASE_PATH if p not in tail]
    main = types.ModuleType("__main__")
    main.__dict__.update(__annotations__={}, __builtins__=builtins)
    if args[0] == "-c":
        sys.path[:] = ["", *tail]
        main.__loader__ = importlib.machinery.BuiltinImporter
        run = compile(args[1], "<string>", "exec"), main.__dict__
        sys.argv = ["-c", *args[2:]]
    elif args[0] == "-m":
        sys.path[:] = [os.getcwd(), *tail]
        run = "module", args[1]
        sys.argv = ["-m", *args[2:]]
    else:
        path = os.path.join(os.getcwd(), args[0])
        sys.path[:] = [os.path.dirname(os.path.realpath(path)), *tail]
        main.__dict__.update(__file__=path, __cached__=None)
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
        with open(path, "rb") as source:
            run = compile(source.read(), path, "exec"), main.__dict__
        sys.argv = list(args)
    sys.orig_argv = [sys.executable, *args]
    sys.modules["__main__"] = main
    sys.path_importer_cache.clear()
    importlib.invalidate_caches()
    linecache.clearcache()
    tempfile.tempdir = None  # read from TMPDIR at first use, as in a fresh interpreter
    _fresh_process_state()
    _hide_preloaded()
    if entries:
        _run_sitecustomize()
    return run


def _run_sitecustomize() -> None:
    """``site``'s import of sitecustomize, from the path it has then: the run's PYTHONPATH may hold one
    (a harness's) that the server's start did not see. The script's folder comes first only after."""
    import site

    first = sys.path.pop(0)
    sys.modules.pop("sitecustomize", None)
    site.execsitecustomize()
    sys.path.insert(0, first)


_PRELOADED = []  # what each preload added: (its torch modules, atexit registrations, warning filters)


def _preload(name: str) -> tuple:
    """Import ``name``, noting what its import added, so that a child can hide it until its script imports it."""
    import atexit
    import importlib
    import warnings

    modules, filters, registered = set(sys.modules), list(warnings.filters), []
    register = atexit.register
    atexit.register = lambda function, *args, **kwargs: registered.append((function, args, kwargs)) or function
    try:
        importlib.import_module(name)
    finally:
        atexit.register = register
    added = {n: m for n, m in sys.modules.items() if n not in modules and (n == "torch" or n.startswith("torch."))}
    return added, registered, [f for f in warnings.filters if f not in filters]


class _Preloaded:
    """The path finder's lookup while a preloaded group is hidden (the path finder is asked after
    every finder autogaudi puts on ``sys.meta_path``, as for any module on a path). A group comes
    back as the script first imports one of its modules: each module's own spec, whose loader gives
    the module already executed and executes nothing, every module of the group in its import order
    (import watchers see theirs), then its atexit handlers and warning filters."""

    def __init__(self, groups: list):
        from importlib.machinery import PathFinder

        self.groups, self.path_finder, self.own = list(groups), PathFinder, PathFinder.__dict__["find_spec"]
        self.find, self.restoring = PathFinder.find_spec, False
        PathFinder.find_spec = self.find_spec

    def find_spec(self, fullname, path=None, target=None):
        group = next((g for g in self.groups if fullname in g[0]), None)
        module = group and group[0][fullname]
        if group is None or not _importable(fullname, module):
            return self.find(fullname, path, target)
        spec = module.__spec__
        loader = spec.loader = module.__loader__  # the loader a wrapper of an earlier look may have replaced

        def exec_module(_):  # the import itself (a look, importlib.util.find_spec, only finds)
            del loader.create_module, loader.exec_module
            if group in self.groups and not self.restoring:
                self._restore(group)

        loader.create_module, loader.exec_module = (lambda _: module), exec_module
        return spec

    def _restore(self, group) -> None:
        """Each module of the group imported again in the order it was (instantly: each is the one
        executed), so that import watchers see theirs; then what its import registered."""
        import atexit
        import importlib
        import warnings

        modules, registered, filters = group
        self.restoring = True
        try:
            for name, module in modules.items():
                if name not in sys.modules and _importable(name, module):
                    importlib.import_module(name)
        finally:
            self.restoring = False
        self.groups.remove(group)
        if not self.groups:
            self.path_finder.find_spec = self.own  # the class's own again
        for name, module in modules.items():
            sys.modules.setdefault(name, module)
        for function, args, kwargs in registered:
            atexit.register(function, *args, **kwargs)
        warnings.filters[:0] = filters
        warnings._filters_mutated()
        if "torch" in modules:
            _autoload_device_backends(modules["torch"])


def _autoload_device_backends(torch) -> None:
    """What torch's import ends with, from this run's path and environment (the server's own import
    loaded no device backend: the HPU double's entry point comes with a run's PYTHONPATH)."""
    if torch._is_device_backend_autoload_enabled():
        torch._import_device_backends()


def _importable(name: str, module) -> bool:
    spec = getattr(module, "__spec__", None)
    return spec is not None and spec.name == name and getattr(module, "__loader__", None) is not None


def _hide_preloaded() -> None:
    import warnings

    for modules, _, filters in _PRELOADED:
        for name in modules:
            sys.modules.pop(name, None)
        for entry in filters:
            warnings.filters.remove(entry)
    warnings._filters_mutated()
    _Preloaded(_PRELOADED)


def _fresh_process_state() -> None:
    """What the server's imports fixed at their import and a fresh interpreter draws anew."""
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        mp_process.ORIGINAL_DIR = os.path.abspath(os.getcwd())  # spawn children find the script from it
        mp_process.current_process().authkey = os.urandom(32)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _as_uncaught(error: BaseException) -> None:
    """What the interpreter does with an exception out of the main module, less the server's frames."""
    trace = error.__traceback__
    while trace is not None and trace.tb_frame.f_code.co_filename == __file__:
        trace = trace.tb_next
    error = error.with_traceback(trace)
    sys.last_type, sys.last_value, sys.last_traceback = type(error), error, trace
    sys.excepthook(type(error), error, trace)


if __name__ == "__main__":
    _what, _where = _become(*_serve(int(sys.argv[1])))
    try:
        if _what == "module":
            import runpy

            runpy._run_module_as_main(_where)
        else:
            exec(_what, _where)
    except SystemExit:
        raise
    except BaseException as _error:
        _as_uncaught(_error)
        if _what != "module":
            _where.pop("__file__", None)
            _where.pop("__cached__", None)
        if isinstance(_error, KeyboardInterrupt):  # out of the main module, the interpreter exits by SIGINT
            sys.excepthook = lambda *_: None
            raise _error from None
        raise SystemExit(1) from None
    if _what != "module":
        _where.pop("__file__", None)
        _where.pop("__cached__", None)
