"""Helpers shared by the tests: paths and a subprocess runner with a clean environment."""
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SCRIPTS = TESTS / "scripts"
HPU_DOUBLE = TESTS / "hpu_double"


def clean_env(**extra):
    """The environment of a plain run: no autogaudi settings inherited from whoever runs pytest."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOGAUDI") and k != "PT_HPU_LAZY_MODE"}
    env.pop("PYTHONPATH", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_python(*args, env=None, cwd=None, timeout=180):
    """Run ``python *args`` and return the CompletedProcess (text mode)."""
    return subprocess.run([sys.executable, *map(str, args)], env=clean_env() if env is None else env,
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)
