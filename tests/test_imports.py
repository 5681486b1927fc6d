"""What starting autogaudi loads: only the units that can act here, nothing for a feature not asked for.

Every module imported at start is time a short run pays for nothing; what a start may cost in all
is benchmarks/startup.py's budget, not a list of modules pinned here (docs/benchmarks.md, start-up).
Each check runs in a fresh process and reads its ``sys.modules``.
"""

import json

import pytest

from autogaudi.core.registry import UNITS
from tests.helpers import clean_env, run_python

ENABLED_ON_CPU = r"""
import json, sys
import torch
import autogaudi
autogaudi.enable(device="cpu", quiet=True, disable=sys.argv[1])
rows = autogaudi.report().as_dict()["units"]
print(json.dumps({"modules": sorted(sys.modules), "rows": {row["name"]: row for row in rows}}))
"""


def started_on_cpu(tmp_path, disable=""):
    env = clean_env(AUTOGAUDI_NO_CACHE="0", AUTOGAUDI_CACHE_DIR=tmp_path / "cache")
    result = run_python("-c", ENABLED_ON_CPU, disable, env=env, fresh=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def unit_module(info) -> str:
    return info.module.split(":")[0]


def test_a_cpu_start_loads_no_unit_that_cannot_act_there_and_no_page_doctor_or_compiler(tmp_path):
    seen = started_on_cpu(tmp_path)
    modules = set(seen["modules"])
    elsewhere = [info for info in UNITS if "cpu" not in info.backends]
    opt_in = [info for info in UNITS if info.opt_in or info.switched_on_by]  # no option here switches one on
    assert elsewhere and opt_in
    assert not {unit_module(info) for info in elsewhere + opt_in} & modules
    assert not {
        name for name in modules if name == "autogaudi.reporting.page" or name.startswith("autogaudi.diagnosis")
    }
    assert "torch._dynamo" not in modules and "torch._inductor" not in modules
    assert "autogaudi.backends.cuda" not in modules  # probed without its module: torch sees no CUDA device
    # every unit still has its row, those not loaded for their backend with the code a loaded one gives
    assert set(seen["rows"]) == {info.name for info in UNITS}
    for info in set(elsewhere) - set(opt_in):
        row = seen["rows"][info.name]
        assert (row["status"], row["reason_code"], row["reason_params"]["backend"]) == (
            "skipped",
            "other_backend",
            "cpu",
        )
    for info in opt_in:
        assert seen["rows"][info.name]["reason_code"] in ("opt_in", "off_by_default", "other_backend")
    # no --memory-limit: a unit that needs a budget is not loaded on the CPU, and is not needed
    budgeted = [info for info in UNITS if info.needs_budget]
    assert budgeted and not {unit_module(info) for info in budgeted} & modules
    for row in (seen["rows"][info.name] for info in budgeted):
        assert (row["status"], row["reason_code"]) == ("not needed", "no_budget")
    loaded = [
        info
        for info in UNITS
        if "cpu" in info.backends and info not in opt_in and not info.waits_for and not info.needs_budget
    ]
    assert {unit_module(info) for info in loaded} <= modules
    # the units that wait for a loader or the step profile are loaded when one comes: their rows watch
    waiting = [info for info in UNITS if "cpu" in info.backends and info not in opt_in and info.waits_for]
    assert waiting and not {unit_module(info) for info in waiting} & modules
    for info in waiting:
        assert (seen["rows"][info.name]["status"], seen["rows"][info.name]["reason_code"]) == ("watching", info.waiting)


# What the units run only once they act: a census after warm-up, a loader's timing, an update timed
# against torch's, graph capture's compile records and one-offs. A run that has not got there imports
# none of it, not even where a step's torch.optim constructor reads every imported module
# (inspect.getmodule).
RUN_ON_FIRST_USE = (
    "autogaudi.optimizations.step_profiler.census",
    "autogaudi.optimizations.step_profiler.classification",
    "autogaudi.optimizations.loader_workers.loader_state",
    "autogaudi.optimizations.fused_optimizer.update_times",
    "autogaudi.optimizations.graph_capture.compile_counts",
    "autogaudi.optimizations.shape_buckets.check",
    "autogaudi.measure.one_offs",
    "autogaudi.optimizations.step_profiler.training_model",
    "autogaudi.watch.model_call",
    "autogaudi.reporting.output_file",  # no --report
)


def test_a_first_step_imports_no_mechanism_before_its_unit_acts(tmp_path):
    script = tmp_path / "steps.py"
    script.write_text(STEPS)
    env = clean_env(AUTOGAUDI_NO_CACHE="0", AUTOGAUDI_CACHE_DIR=tmp_path / "cache")
    result = run_python("-m", "autogaudi", "--quiet", script, "1", *RUN_ON_FIRST_USE, env=env, fresh=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_a_disabled_unit_is_not_imported(tmp_path):
    seen = started_on_cpu(tmp_path, disable="loader_workers")
    assert "autogaudi.optimizations.loader_workers" not in seen["modules"]
    assert seen["rows"]["loader_workers"]["reason_code"] == "switched_off"


def test_the_launcher_and_the_doctor_do_not_import_each_other():
    watched = ("autogaudi.entry.launcher", "autogaudi.diagnosis", "torch")

    def loads(module):
        return run_python("-c", f"import sys, {module}; print(sorted(n for n in {watched!r} if n in sys.modules))")

    launcher, doctor = loads("autogaudi.entry.launcher"), loads("autogaudi.diagnosis.command")
    assert launcher.returncode == 0 and doctor.returncode == 0, launcher.stderr + doctor.stderr
    assert launcher.stdout.strip() == "['autogaudi.entry.launcher']"  # neither the doctor nor torch before the script
    assert "autogaudi.entry.launcher" not in doctor.stdout


STEPS = """
import sys
import torch

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(int(sys.argv[1])):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
print(sorted(name for name in sys.argv[2:] if name in sys.modules))  # those of the names given imported
"""


@pytest.mark.parametrize("steps, runs", [(1, 1), (12, 2)], ids=["one-step", "reading-the-cache"])
def test_a_quiet_run_imports_neither_psutil_nor_the_report(tmp_path, steps, runs):
    """psutil costs a start 7-20 ms: a quiet run reads the machine's memory without it (the fused
    optimizer's check on copies at the first step), names the machine in the cache's keys by its
    logical CPUs (a second run reads the first one's decisions after warm-up), and builds no report,
    so loads none."""
    script = tmp_path / "steps.py"
    script.write_text(STEPS)
    env = clean_env(AUTOGAUDI_NO_CACHE="0", AUTOGAUDI_CACHE_DIR=tmp_path / "cache")
    for _ in range(runs):
        result = run_python(
            "-m",
            "autogaudi",
            "--quiet",
            script,
            str(steps),
            "psutil",
            "autogaudi.reporting.record",
            env=env,
            fresh=True,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[]"
