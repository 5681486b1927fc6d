"""A seeded script under the defaults gives the same numbers run after run: on an empty cache (a
first run, which measures) and on a warm one (which follows what the first remembered), and plain
PyTorch's wherever the report names no unit that changed them. Whole processes, the real clock: the
decisions that change numbers are taken at the same step in every run, on gains far from any line
noise could move (tests/optimizations/test_fused_optimizer.py decides them on injected timings)."""

import json

import pytest

from tests.helpers import SCRIPTS, clean_env, run_python

SCRIPTS_RUN = [SCRIPTS / "seeded_train.py", SCRIPTS / "rl_loop.py"]


def numbers(result) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS_RUN, ids=lambda path: path.stem)
def test_a_seeded_script_prints_the_same_numbers_on_an_empty_and_on_a_warm_cache(tmp_path, script):
    plain = numbers(run_python(script, env=clean_env()))
    env = clean_env(AUTOGAUDI_NO_CACHE="0", AUTOGAUDI_CACHE_DIR=tmp_path / "cache")
    runs = {}
    for name in ("empty", "warm"):
        report = tmp_path / f"{name}.json"
        result = run_python("-m", "autogaudi", "--quiet", "--report", report, script, env=env)
        named = {row["unit"] for row in json.loads(report.read_text())["numerics"]}
        runs[name] = numbers(result), named
    assert runs["warm"] == runs["empty"]
    measured, named = runs["empty"]
    assert (measured == plain) == (not named), named
