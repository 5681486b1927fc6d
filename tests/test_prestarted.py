"""The pre-started interpreter against a real one: the same CompletedProcess for every way a script
can start and end, and real interpreters wherever a fork could be told apart."""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests import prestarted, prestarted_route
from tests.helpers import HPU_DOUBLE, REPO, clean_env, run_python

SHOW = """
import json, os, signal, sys
main = __import__("__main__")
print(json.dumps({
    "argv": sys.argv, "orig_argv": sys.orig_argv, "path": sys.path, "cwd": os.getcwd(), "name": __name__,
    "main": sorted((k, type(v).__name__) for k, v in vars(main).items() if k != "json"),
    "file": getattr(main, "__file__", None), "spec": getattr(main.__spec__, "name", None),
    "env": dict(os.environ), "tmp": __import__("tempfile").gettempdir(),
    "signals": {s.name: str(signal.getsignal(s)) for s in signal.valid_signals() if isinstance(s, signal.Signals)},
    "stdio": [(f.name, f.encoding, f.errors, f.line_buffering, f.isatty())
              for f in (sys.stdin, sys.stdout, sys.stderr)],
}, sort_keys=True))
"""


def py(*lines):
    return "\n".join(lines) + "\n"


# The server takes only a script that names torch. A case about how a run starts or ends names it
# without importing it: the real interpreter's run then skips torch's import. The cases about the
# script's own import of torch (the server's hidden, preloaded one) import it.
NAMES_TORCH = "# runs as a torch script would"


SPAWN_AND_FORK = py(
    "import multiprocessing as mp",
    NAMES_TORCH,
    "def square(x):",
    "    return x * x",
    "if __name__ == '__main__':",
    "    for method in ('spawn', 'fork'):",
    "        with mp.get_context(method).Pool(1) as pool:",
    "            print(method, pool.map(square, [2, 3]))",
)
PICKLED = py(
    "import pickle",
    NAMES_TORCH,
    "class Point:",
    "    def __init__(self, x):",
    "        self.x = x",
    "data = pickle.dumps(Point(2.0))",
    "print(b'__main__' in data, pickle.loads(data).x)",
)
SITECUSTOMIZE = py(
    "import atexit, sys",
    "print('site', [p for p in sys.path if 'site' in p][:1], '__main__' in sys.modules)",
    "atexit.register(print, 'registered at start')",
)
DEVICE_BACKEND = py(
    "import sys",
    "print('bridge before torch', 'habana_frameworks' in sys.modules)",
    "import torch",
    "print(torch.ones(2, device='hpu').device, sorted(n for n in sys.modules if n.startswith('habana')))",
)
# name -> (files written in the run's folder, python's arguments)
CASES = {
    "normal": ({"s.py": py("import torch", "print('trained', torch.ones(3).sum().item())")}, ["s.py"]),
    "sys_exit_3": ({"s.py": py("import sys", NAMES_TORCH, "print('out')", "sys.exit(3)")}, ["s.py"]),
    "sys_exit_message": ({"s.py": py("import sys", NAMES_TORCH, "sys.exit('bad input')")}, ["s.py"]),
    "uncaught": (
        {"s.py": py(NAMES_TORCH, "def f(x):", "    return x / 0", "print('before')", "f(1.0)")},
        ["s.py"],
    ),
    "chained": (
        {"s.py": py(NAMES_TORCH, "try:", "    {}['k']", "except KeyError as e:", "    raise ValueError('v') from e")},
        ["s.py"],
    ),
    "keyboard_interrupt": (
        {"s.py": py("import atexit", NAMES_TORCH, "atexit.register(print, 'bye')", "raise KeyboardInterrupt")},
        ["s.py"],
    ),
    "os_exit": (
        {
            "s.py": py(
                "import os, atexit",
                NAMES_TORCH,
                "atexit.register(print, 'never')",
                "print('lost', end='')",
                "os._exit(7)",
            )
        },
        ["s.py"],
    ),
    "sigterm_self": ({"s.py": py("import os, signal", NAMES_TORCH, "os.kill(os.getpid(), signal.SIGTERM)")}, ["s.py"]),
    "atexit": (
        {
            "s.py": py(
                "import atexit", NAMES_TORCH, "atexit.register(lambda: print('at exit', '__file__' in globals()))"
            )
        },
        ["s.py"],
    ),
    "thread_after_main": (
        {
            "s.py": py(
                "import threading, time",
                NAMES_TORCH,
                "threading.Thread(target=lambda: (time.sleep(0.3), print('thread'))).start()",
            )
        },
        ["s.py"],
    ),
    "no_newline": (
        {"s.py": py("import sys", NAMES_TORCH, "print('partial', end='')", "sys.stderr.write('err no newline')")},
        ["s.py"],
    ),
    "unclosed_file": ({"s.py": py(NAMES_TORCH, "f = open('left.txt', 'w')", "f.write('kept at exit')")}, ["s.py"]),
    "stdin_eof": ({"s.py": py("import sys", NAMES_TORCH, "print(repr(sys.stdin.read()))")}, ["s.py"]),
    "module": (
        {"pkg/__init__.py": "", "pkg/mod.py": py("import torch", SHOW, "raise RuntimeError('in a module')")},
        ["-m", "pkg.mod", "a", "--b"],
    ),
    "package_main": ({"pkg/__init__.py": "", "pkg/__main__.py": py("import torch", SHOW)}, ["-m", "pkg", "x"]),
    "command": ({}, ["-c", py("import torch", SHOW, "print(1 / 0)"), "arg"]),
    "script_as_given": ({"sub/s.py": py(NAMES_TORCH, SHOW)}, ["./sub/../sub/s.py", "--lr", "3"]),
    "symlinked_script": ({"sub/s.py": py(NAMES_TORCH, SHOW), "link.py": "->sub/s.py"}, ["link.py"]),
    "pythonpath_and_env": (
        # a .pth file acts in a site directory only, not on PYTHONPATH
        {
            "lib/helper.py": "VALUE = 5\n",
            "lib/acts.pth": "import sys; print('pth')\n",
            "s.py": py("import helper", NAMES_TORCH, SHOW),
        },
        ["s.py"],
    ),
    "spawn_and_fork_children": ({"s.py": SPAWN_AND_FORK}, ["s.py"]),
    # a harness's sitecustomize on PYTHONPATH, imported at start; the script's own folder holds another
    "sitecustomize": (
        {
            "site/sitecustomize.py": SITECUSTOMIZE,
            "sitecustomize.py": "print('not this one')\n",
            "s.py": py(NAMES_TORCH, SHOW),
        },
        ["s.py"],
    ),
    # the double's entry point on PYTHONPATH: torch's import ends by loading the bridge
    "device_backend_autoload": ({"s.py": DEVICE_BACKEND}, ["s.py"]),
    "pickled_main_class": ({"s.py": PICKLED}, ["s.py"]),
}


def _write(folder, files):
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if text.startswith("->"):
            path.symlink_to(text[2:])
        else:
            path.write_text(text)


@pytest.fixture
def stdin_at_eof():
    """What both ways read from an inherited stdin: nothing (the tests' own may be a terminal)."""
    saved = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    yield
    os.dup2(saved, 0)
    os.close(saved)


def _both_ways(tmp_path, args, env, timeout=120):
    """(real, forked) CompletedProcess of ``python *args``, each in a copy of the folder of its own
    name-alike: the runs see the same paths."""
    results = []
    for forked in (False, True):
        if forked:
            assert prestarted_route.route(args, env, tmp_path) is None
            result = prestarted.run(args, env, tmp_path, timeout)
        else:
            result = subprocess.run(
                [sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout
            )
        results.append((result, _files(tmp_path)))
    return results


def _files(folder):
    left = folder / "left.txt"
    return left.read_text() if left.exists() else None


@pytest.mark.parametrize("case", CASES)
def test_a_run_forked_from_the_server_ends_as_a_real_interpreters(case, tmp_path, stdin_at_eof):
    files, args = CASES[case]
    _write(tmp_path, files)
    env = clean_env(CASE=case)
    if case == "pythonpath_and_env":
        env["PYTHONPATH"] = "lib"
    if case == "sitecustomize":
        env["PYTHONPATH"] = "site"
    if case == "device_backend_autoload":
        env["PYTHONPATH"] = str(HPU_DOUBLE)
    (real, real_file), (forked, forked_file) = _both_ways(tmp_path, args, env)
    assert forked.args == real.args
    assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert forked_file == real_file


def test_the_cases_cover_every_ending():
    """The ends a test must tell apart: not all the same code, output and traceback."""
    assert {"uncaught", "keyboard_interrupt", "sigterm_self", "os_exit", "sys_exit_3"} <= set(CASES)


def test_a_timeout_kills_the_run_and_its_group_and_raises_as_subprocess_does(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        "import subprocess, sys, time, torch\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "open('child.pid', 'w').write(str(child.pid))\nprint('started', flush=True)\ntime.sleep(60)\n"
    )
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        prestarted.run(["s.py"], clean_env(), tmp_path, 8)
    assert raised.value.cmd == [sys.executable, "s.py"] and raised.value.timeout == 8
    assert raised.value.output == b"started\n"
    grandchild = int((tmp_path / "child.pid").read_text())
    for _ in range(100):  # the kill is SIGKILL: gone at once, reaped by whoever its parent was
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild)
    assert time.monotonic() - started < 60


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    ("args", "env", "why"),
    [
        (["s.py"], {"AUTOGAUDI": "1"}, "autogaudi_set"),
        (["-X", "importtime", "s.py"], {}, "interpreter_flags"),
        (["-u", "s.py"], {}, "interpreter_flags"),
        (["s.py"], {"PYTHONPATH": "plugin"}, "pythonpath_acts_at_start"),
        (["s.py"], {"PYTHONPATH": "user"}, "pythonpath_acts_at_start"),
        (["no_torch.py"], {}, "no_torch"),
        (["collects.py"], {}, "names_gc"),
        (["-m", "pip"], {}, "module_not_local"),
        (["missing.py"], {}, "not_a_script_file"),
    ],
)
def test_a_run_a_fork_could_be_told_from_goes_to_a_real_interpreter(tmp_path, args, env, why):
    _write(
        tmp_path,
        {
            "s.py": "import torch\n",
            "no_torch.py": "print('hi')\n",
            "collects.py": "import gc, torch\n",
            # entry points of a group the server's own start may have looked up
            "plugin/plugin-1.0.dist-info/entry_points.txt": "[console_scripts]\nplugin = plugin:main\n",
            "user/usercustomize.py": "",
        },
    )
    assert prestarted_route.route(args, clean_env(**env), tmp_path) == why
    assert prestarted_route.route(["s.py"], clean_env(), tmp_path) is None


def test_fresh_runs_a_real_interpreter(tmp_path, monkeypatch):
    monkeypatch.setattr(prestarted, "run", lambda *a: pytest.fail("fresh=True went to the server"))
    (tmp_path / "s.py").write_text(NAMES_TORCH)
    assert run_python("s.py", cwd=tmp_path, fresh=True).returncode == 0


def test_the_server_exits_when_its_test_process_is_gone(tmp_path):
    starter = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(REPO)!r})
        from tests import prestarted, prestarted_route
        server = prestarted._Server(dict(os.environ))
        print(server.pid, flush=True)
        os._exit(0)
        """
    )
    done = subprocess.run([sys.executable, "-c", starter], env=clean_env(), capture_output=True, text=True, timeout=300)
    pid = done.stdout.strip()
    assert pid.isdigit()
    for _ in range(100):
        if not _alive(int(pid)):
            break
        time.sleep(0.1)
    assert not _alive(int(pid))


LAUNCHED = py(
    "import sys",
    "print('torch before', 'torch' in sys.modules)",
    "import torch",
    "import autogaudi",
    "print('session', autogaudi.is_enabled(), 'torch after', 'torch' in sys.modules)",
)


@pytest.mark.parametrize("script", ["train_tiny.py", "launched.py"])
def test_under_the_launcher_a_forked_run_reports_what_a_real_one_does(script, tmp_path, stdin_at_eof):
    """autogaudi's launcher waits for the script's own import of torch: the server hides its torch
    until then, so the units decide, and the report says, the same."""
    (tmp_path / "launched.py").write_text(LAUNCHED)
    (tmp_path / "train_tiny.py").write_text((REPO / "tests" / "scripts" / "train_tiny.py").read_text())
    args = ["-m", "autogaudi", "--quiet", "--report", "report.json", script]
    seen = []
    for result, _ in _both_ways(tmp_path, args, clean_env()):
        report = json.loads((tmp_path / "report.json").read_text())
        units = [(u["name"], u["status"], u["reason_code"], u["note_codes"]) for u in report["units"]]
        seen.append((result.returncode, result.stdout, result.stderr, report["enabled_by"], report["steps"], units))
    assert seen[0] == seen[1]
