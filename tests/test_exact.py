"""--exact: every unit on under it leaves a seeded run's numbers bit for bit plain PyTorch's (each
loss, the final parameters, the torch, random and numpy streams), and every other unit is off.

Generated from the registry: each unit is checked on the CPU where it applies there, else on the HPU
double (lazy mode), in one run per backend with every opt-in unit asked for, against the plain run.
"""

import importlib
import json
import types

import pytest

from autogaudi.core.registry import OPT_IN_UNITS, UNITS
from tests.helpers import HPU_DOUBLE, SCRIPTS, SWITCHED_ON_BY, clean_env, plain_run, run_python

SCRIPT = SCRIPTS / "seeded_train.py"
# hpu: lazy (1.19), the bridge loaded by `import torch` all the same (PT_HPU_AUTOLOAD), the model moved to hpu
HPU_ENV = {"PYTHONPATH": str(HPU_DOUBLE), "HPU_DOUBLE_RELEASE": "1.19", "PT_HPU_AUTOLOAD": "1", "DEVICE": "hpu"}
ENVIRONMENTS = {"cpu": {}, "hpu": HPU_ENV}
BACKENDS = {
    "cpu": types.SimpleNamespace(name="cpu", is_lazy=False),
    "hpu": types.SimpleNamespace(name="hpu", is_lazy=True),
}
IN_FORCE = ("applied", "watching", "not needed")


def unit_class(info):
    module, name = info.module.split(":")
    return getattr(importlib.import_module(module), name)


def numbers(result) -> dict:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """backend -> (the plain run's numbers, the --exact run's, its report), each run once."""
    done = {}

    def run(backend):
        if backend not in done:
            env = clean_env(**ENVIRONMENTS[backend])
            plain = numbers(plain_run(SCRIPT, **ENVIRONMENTS[backend]))
            report = tmp_path_factory.mktemp(backend) / "report.json"
            # not --memory-limit on hpu: the double's HPU tensors cannot go through the memory forecast's
            # fake tensors (autograd aborts: torch's CPU build has no hpu device guard), and no hpu-only unit needs it
            switched_on = [
                f"--{key.replace('_', '-')}={value}"
                for unit in SWITCHED_ON_BY.values()
                for key, value in unit.items()
                if not (backend == "hpu" and key == "memory_limit")
            ]
            exact = run_python(
                "-m", "autogaudi", "--exact", "--force", ",".join(OPT_IN_UNITS), *switched_on, "--quiet",
                "--report", report, SCRIPT, env=env,
            )  # fmt: skip
            done[backend] = plain, numbers(exact), json.loads(report.read_text())
        return done[backend]

    return run


@pytest.mark.parametrize("info", UNITS, ids=lambda info: info.name)
def test_under_exact_a_unit_is_on_only_where_it_leaves_every_number_plain(info, runs):
    unit = unit_class(info)
    backend = "cpu" if "cpu" in info.backends else "hpu"
    plain, exact, report = runs(backend)
    row = next(row for row in report["units"] if row["name"] == info.name)
    if unit.numerics_on(BACKENDS[backend]):
        # off: itself, or through a unit it requires that is
        assert (row["status"], row["reason_code"]) in {("skipped", "not_exact"), ("skipped", "needs_unit")}, row
    else:
        assert row["status"] in IN_FORCE, row
        assert exact == plain


RL_LOOP = SCRIPTS / "rl_loop.py"


def test_a_seeded_rl_loop_under_exact_is_the_plain_run_bit_for_bit():
    assert numbers(run_python("-m", "autogaudi", "--exact", "--quiet", RL_LOOP)) == numbers(plain_run(RL_LOOP))


@pytest.mark.slow
@pytest.mark.parametrize("options", [[], ["--disable", "fused_optimizer"]], ids=["defaults", "unfused"])
def test_by_default_the_rl_loop_is_the_plain_run_unless_the_report_names_what_changed_its_numbers(tmp_path, options):
    result = run_python("-m", "autogaudi", *options, "--report", tmp_path / "report.json", RL_LOOP)
    rows = json.loads((tmp_path / "report.json").read_text())["numerics"]
    named = {row["unit"]: row["how"] for row in rows}
    assert (numbers(result) == numbers(plain_run(RL_LOOP))) == (not named), named
    # its fused Adam is timed on copies and not used: a fraction of a step of many forwards, no gain
    # worth the rounding (a run that kept it would name it here, and its numbers would differ)
    assert named == {}
