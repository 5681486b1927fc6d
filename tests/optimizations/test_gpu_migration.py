"""gpu_migration and the device units' refusal off the device, on the HPU double.

Each run is a subprocess (the toolkit, like the real one, patches torch for the rest of the process):
``python -m autogaudi`` on a CUDA-written script with the double on ``PYTHONPATH`` and its recorded
placement (``HPU_DOUBLE_PLACEMENT=recorded``: only tensors the double put on hpu count as there).
Assertions are on the report's codes, figures and the double's record, and on the losses.
"""

import json

import pytest

from autogaudi.optimizations.gpu_migration import read_script
from tests.helpers import HPU_DOUBLE, SCRIPTS, clean_env, run_python

# The units that act for the device, which step aside off it (fused_optimizer: its hpex path).
DEVICE_UNITS = ("step_marks", "fused_optimizer", "fused_clip_norm", "pin_memory", "static_last_batch")


def run(tmp_path, script, *flags, double=True, **env):
    report = tmp_path / "report.json"
    extra = {"PYTHONPATH": str(HPU_DOUBLE), "HPU_DOUBLE_PLACEMENT": "recorded"} if double else {}
    result = run_python("-m", "autogaudi", "--report", report, *flags, SCRIPTS / script, env=clean_env(**extra, **env))
    assert result.returncode == 0, result.stderr
    return json.loads(report.read_text()), result


def plain_loss(script, **env):
    """The script as written, without autogaudi or the double: on this machine, the CPU."""
    result = run_python(SCRIPTS / script, env=clean_env(**env))
    assert result.returncode == 0, result.stderr
    return loss_of(result)


def loss_of(result) -> float:
    return float(result.stdout.split("loss ")[-1])


def rows(report) -> dict:
    return {row["name"]: row for row in report["units"]}


def test_the_script_and_its_own_modules_are_read_for_cuda_and_for_libraries_it_cannot_map(tmp_path):
    found = read_script(str(SCRIPTS / "cuda_train.py"))
    assert any(where.startswith("cuda_train.py:") for where in found["cuda"])
    assert read_script(str(SCRIPTS / "cpu_train.py"))["cuda"] == []
    (tmp_path / "helpers.py").write_text("import triton\nx = 'cuda'\n")
    (tmp_path / "main.py").write_text("import helpers\n")
    found = read_script(str(tmp_path / "main.py"))
    assert found["cuda"] == ["helpers.py:2"]
    assert found["not_mapped"] == {"triton": "helpers.py:1"}


@pytest.mark.parametrize("style", ["examples", "dot"])
def test_a_cuda_script_trains_on_hpu_through_intels_migration_under_the_defaults(tmp_path, style):
    report, _ = run(tmp_path, "cuda_train.py", STYLE=style)
    units = rows(report)
    migration = units["gpu_migration"]
    assert migration["reason_code"] == "mapped"
    assert migration["figures"]["switched_on_by"] == "autogaudi"
    assert migration["figures"]["mapped_calls"] > 0
    assert report["backend"]["migration"]["asked_for"] == "cuda"
    assert report["backend"]["migration"]["ran_on"] == "hpu"
    assert report["backend"]["placement"]["on_device"] is True
    assert units["step_marks"]["figures"]["mark_steps"] > 0
    assert units["fused_clip_norm"]["figures"]["fused_calls"] > 0
    assert units["fused_optimizer"]["figures"]["optimizers_fused"] == 1
    for name in DEVICE_UNITS:
        assert units[name]["reason_code"] != "model_not_on_device"


@pytest.mark.parametrize("style", ["examples", "dot"])
def test_every_parameter_and_every_batch_is_recorded_on_hpu_and_none_without_migration(tmp_path, style):
    _, result = run(tmp_path, "cuda_train.py", STYLE=style, PLACEMENT="1")
    counts = dict(line.split(" on hpu ") for line in result.stdout.splitlines() if " on hpu " in line)
    assert counts.keys() == {"parameters", "batches"}
    assert all(hpu == total for hpu, _, total in (count.split() for count in counts.values())), counts
    assert counts["batches"] == "28 of 28"  # 7 batches of inputs and targets, two epochs
    _, result = run(tmp_path, "cuda_train.py", "--disable", "gpu_migration", STYLE=style, PLACEMENT="1")
    assert "parameters on hpu 0 of" in result.stdout and "batches on hpu 0 of 28" in result.stdout


def test_the_migrated_run_computes_what_the_script_computes_on_the_host(tmp_path):
    """The double's device is the CPU: the mapped run (its padding off, which changes the batches)
    ends on plain's loss, up to the fused kernels' rounding."""
    _, result = run(tmp_path, "cuda_train.py", "--disable", "static_last_batch")
    assert loss_of(result) == pytest.approx(plain_loss("cuda_train.py"), rel=1e-4)


@pytest.mark.slow
def test_disabled_migration_runs_the_script_as_written_and_the_device_units_step_aside(tmp_path):
    report, result = run(tmp_path, "cuda_train.py", "--disable", "gpu_migration")
    units = rows(report)
    assert units["gpu_migration"]["reason_code"] == "switched_off"
    assert "migration" not in report["backend"]
    assert report["backend"]["placement"] == {"device": "cpu", "at": "optimizer's construction", "on_device": False}
    for name in DEVICE_UNITS:
        assert units[name]["reason_code"] == "model_not_on_device", name
    # stepped aside before the first epoch: no step marked, no batch padded, the loss is plain's
    assert units["step_marks"]["figures"]["mark_steps"] == 0
    assert loss_of(result) == plain_loss("cuda_train.py")


@pytest.mark.slow
def test_a_cpu_only_script_is_not_migrated_and_the_device_units_step_aside(tmp_path):
    report, result = run(tmp_path, "cpu_train.py")
    units = rows(report)
    assert units["gpu_migration"]["reason_code"] == "script_not_cuda"
    assert report["backend"]["placement"]["on_device"] is False
    for name in DEVICE_UNITS:
        assert units[name]["reason_code"] == "model_not_on_device", name
    assert loss_of(result) == plain_loss("cpu_train.py")


def test_the_toolkit_is_left_to_an_environment_that_switched_it_on(tmp_path):
    report, _ = run(tmp_path, "cuda_train.py", PT_HPU_GPU_MIGRATION="1")
    assert rows(report)["gpu_migration"]["figures"]["switched_on_by"] == "environment"
    assert report["backend"]["placement"]["on_device"] is True


def test_off_the_hpu_the_unit_does_not_apply(tmp_path):
    report, _ = run(tmp_path, "cuda_train.py", double=False)
    assert rows(report)["gpu_migration"]["reason_code"] == "other_backend"
    assert report["backend"]["placement"]["on_device"] is True  # a CPU backend: the host is the device


def test_the_doubles_toolkit_maps_cuda_calls_onto_its_device_and_records_each():
    code = (
        "import os, torch; os.environ['PT_HPU_GPU_MIGRATION'] = '1'; import habana_frameworks.torch; "
        "from habana_frameworks.torch import _calls, gpu_migration; _calls.reset(); "
        "model = torch.nn.Linear(2, 2).cuda(); x = torch.ones(2, device='cuda'); y = torch.ones(2).to('cuda'); "
        "print(torch.cuda.is_available(), gpu_migration.mapped_calls(), [d['call'] for n, d in _calls.CALLS], "
        "all(_calls.placed(t) for t in (model.weight, x, y)), _calls.placed(torch.ones(2)))"
    )
    result = run_python("-c", code, env=clean_env(PYTHONPATH=str(HPU_DOUBLE), HPU_DOUBLE_PLACEMENT="recorded"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "True",
        "4",
        "['Module.cuda',",
        "'torch.ones',",
        "'Tensor.to',",
        "'torch.cuda.is_available']",
        "True",
        "False",
    ]


def test_a_bridge_loaded_before_autogaudi_leaves_the_toolkit_off_and_the_cuda_check_is_recommended(tmp_path):
    report, _ = run(tmp_path, "cuda_train.py", IMPORT_BRIDGE_FIRST="1")
    units = rows(report)
    migration = units["gpu_migration"]
    assert migration["reason_code"] == "bridge_loaded_first"
    assert "cuda_asked_at_run_time" in migration["note_codes"]
    assert [advice["code"] for advice in migration["recommendations"]] == ["set_variable"]
    for name in DEVICE_UNITS:
        assert units[name]["reason_code"] == "model_not_on_device", name


def test_a_package_found_through_pythonpath_is_read_as_the_users_own(tmp_path, monkeypatch):
    """minGPT's layout: ``PYTHONPATH=. python projects/adder/adder.py``, CUDA asked for in the package."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "trainer.py").write_text("device = 'cuda'\n")
    (tmp_path / "projects").mkdir()
    (tmp_path / "projects" / "train.py").write_text("from pkg.trainer import device\n")
    assert read_script(str(tmp_path / "projects" / "train.py"))["cuda"] == []
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert read_script(str(tmp_path / "projects" / "train.py"))["cuda"] == ["../pkg/trainer.py:1"]
    # a PYTHONPATH entry the script is not under holds libraries, not the user's code
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "library.py").write_text("device = 'cuda'\n")
    (tmp_path / "projects" / "uses_library.py").write_text("import library\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'lib'}:{tmp_path / 'projects'}")
    assert read_script(str(tmp_path / "projects" / "uses_library.py"))["cuda"] == []
