"""gpu_migration and the device units' refusal off the device, on the HPU double.

Each run is a subprocess (the toolkit, like the real one, patches torch for the rest of the process):
a CUDA-written script with the double on ``PYTHONPATH``, whose HPU tensors report ``hpu`` (a host
tensor is a host one), under the release it models (``HPU_DOUBLE_RELEASE``: ``latest`` loads the
bridge during ``import torch``). Assertions are on the report's codes, figures, the tensors' devices
and the losses.
"""

import json

import pytest

from autogaudi.entry.script_source import read_script
from tests.helpers import HPU_DOUBLE, SCRIPTS, clean_env, plain_run, run_python

# The units that act for the device, which step aside off it (fused_optimizer: its hpex path).
DEVICE_UNITS = ("step_marks", "fused_optimizer", "fused_clip_norm", "pin_memory", "static_last_batch")


def stepped_aside(units, name) -> bool:
    """Whether a device unit stepped aside for a model off the device (step_marks and static_last_batch
    are off in eager mode whatever the model: the double's latest release is eager by default)."""
    return units[name]["reason_code"] in ("model_not_on_device", "hpu_eager")


RELEASES = ("latest", "1.19")


def run(tmp_path, script, *flags, double=True, release="latest", entry="launcher", **env):
    """The script run by ``entry``: the launcher, ``AUTOGAUDI=1``, or ``enable()`` in the script
    (``first``: before anything else; ``after_torch``)."""
    report = tmp_path / "report.json"
    extra = {"PYTHONPATH": str(HPU_DOUBLE), "HPU_DOUBLE_RELEASE": release} if double else {}
    if entry == "launcher":
        command = ("-m", "autogaudi", "--report", report, *flags, SCRIPTS / script)
    else:
        assert not flags
        command = (SCRIPTS / script,)
        extra.update(AUTOGAUDI_REPORT=report, **({"AUTOGAUDI": "1"} if entry == "environment" else {"ENABLE": entry}))
    result = run_python(*command, env=clean_env(**extra, **env))
    assert result.returncode == 0, result.stderr
    return json.loads(report.read_text()), result


def devices(result) -> dict:
    """What cuda_train.py printed with PLACEMENT=1: {"parameters": "4 of 4", "batches": ...} on hpu."""
    return dict(line.split(" on hpu ") for line in result.stdout.splitlines() if " on hpu " in line)


def plain_loss(script, **env):
    """The script as written, without autogaudi or the double: on this machine, the CPU."""
    result = plain_run(SCRIPTS / script, **env)
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


@pytest.mark.parametrize("style, release", [("examples", "latest"), ("dot", "1.19")])
def test_a_cuda_script_trains_on_hpu_through_intels_migration_under_the_defaults(tmp_path, style, release):
    report, result = run(tmp_path, "cuda_train.py", release=release, STYLE=style, PLACEMENT="1")
    units = rows(report)
    migration = units["gpu_migration"]
    assert migration["reason_code"] == "mapped"
    assert migration["figures"]["switched_on_by"] == "autogaudi"
    assert migration["figures"]["mapped_calls"] > 0
    assert report["backend"]["migration"]["asked_for"] == "cuda"
    assert report["backend"]["migration"]["ran_on"] == "hpu"
    assert report["backend"]["placement"]["on_device"] is True
    assert report["backend"]["lazy"] is (release == "1.19")
    assert devices(result) == {"parameters": "4 of 4", "batches": "28 of 28"}  # 7 batches of 2 tensors, 2 epochs
    if release == "1.19":
        assert units["step_marks"]["figures"]["mark_steps"] > 0
    assert units["fused_clip_norm"]["figures"]["fused_calls"] > 0
    assert units["fused_optimizer"]["figures"]["optimizers_fused"] == 1
    for name in DEVICE_UNITS:
        assert units[name]["reason_code"] != "model_not_on_device"


@pytest.mark.parametrize(
    "entry, style, release",
    [
        ("environment", "dot", "latest"),
        ("environment", "examples", "1.19"),
        ("first", "examples", "latest"),
        ("first", "dot", "1.19"),
    ],
)
def test_every_entry_point_started_before_torch_lands_every_parameter_and_batch_on_hpu(tmp_path, entry, style, release):
    """With the launcher's test above, every pair of entry point, style and release is run once (a
    subprocess each: the whole product would be twelve)."""
    report, result = run(tmp_path, "cuda_train.py", release=release, entry=entry, STYLE=style, PLACEMENT="1")
    assert rows(report)["gpu_migration"]["figures"]["switched_on_by"] == "autogaudi"
    assert devices(result) == {"parameters": "4 of 4", "batches": "28 of 28"}


def test_without_migration_the_script_runs_on_the_host_as_written_under_the_lazy_release(tmp_path):
    """The latest release: the test after next, whose run is the same."""
    _, result = run(tmp_path, "cuda_train.py", "--disable", "gpu_migration", release="1.19", PLACEMENT="1")
    assert devices(result) == {"parameters": "0 of 4", "batches": "0 of 28"}


def test_the_migrated_run_computes_what_the_script_computes_on_the_host(tmp_path):
    """The double's device is the CPU: the mapped run (its padding off, which changes the batches)
    ends on plain's loss, up to the fused kernels' rounding."""
    _, result = run(tmp_path, "cuda_train.py", "--disable", "static_last_batch")
    assert loss_of(result) == pytest.approx(plain_loss("cuda_train.py"), rel=1e-4)


@pytest.mark.slow
def test_disabled_migration_runs_the_script_as_written_and_the_device_units_step_aside(tmp_path):
    report, result = run(tmp_path, "cuda_train.py", "--disable", "gpu_migration", PLACEMENT="1")
    assert devices(result) == {"parameters": "0 of 4", "batches": "0 of 28"}
    units = rows(report)
    assert units["gpu_migration"]["reason_code"] == "switched_off"
    assert "migration" not in report["backend"]
    assert report["backend"]["placement"] == {"device": "cpu", "at": "optimizer's construction", "on_device": False}
    for name in DEVICE_UNITS:
        assert stepped_aside(units, name), name
    # stepped aside before the first epoch: no step marked, no batch padded, the loss is plain's
    assert units["step_marks"]["figures"].get("mark_steps", 0) == 0
    assert loss_of(result) == plain_loss("cuda_train.py")


@pytest.mark.slow
def test_a_script_naming_cuda_that_puts_its_model_on_the_host_is_not_said_to_run_on_hpu(tmp_path):
    report, result = run(tmp_path, "cuda_train.py", STYLE="host")
    assert report["backend"]["migration"]["ran_on"] == "cpu"
    assert report["backend"]["placement"]["on_device"] is False
    assert "model on cpu" in result.stdout
    assert loss_of(result) == pytest.approx(plain_loss("cuda_train.py", STYLE="host"), rel=1e-4)


@pytest.mark.slow
def test_a_cpu_only_script_is_not_migrated_and_the_device_units_step_aside(tmp_path):
    report, result = run(tmp_path, "cpu_train.py")
    units = rows(report)
    assert units["gpu_migration"]["reason_code"] == "script_not_cuda"
    assert report["backend"]["placement"]["on_device"] is False
    for name in DEVICE_UNITS:
        assert stepped_aside(units, name), name
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
        "import os; os.environ['PT_HPU_GPU_MIGRATION'] = '1'; import torch; "
        "from habana_frameworks.torch import _calls, gpu_migration; _calls.reset(); "
        "model = torch.nn.Linear(2, 2).cuda(); x = torch.ones(2, device='cuda'); y = torch.ones(2).to('cuda'); "
        "print(torch.cuda.is_available(), gpu_migration.mapped_calls(), [d['call'] for n, d in _calls.CALLS], "
        "[t.device.type for t in (model.weight, x, y, torch.ones(2))])"
    )
    result = run_python("-c", code, env=clean_env(PYTHONPATH=str(HPU_DOUBLE)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "True",
        "4",
        "['Module.cuda',",
        "'torch.ones',",
        "'Tensor.to',",
        "'torch.cuda.is_available']",
        "['hpu',",
        "'hpu',",
        "'hpu',",
        "'cpu']",
    ]


@pytest.mark.parametrize("release", RELEASES)
def test_a_script_that_imports_the_bridge_before_torch_is_migrated_all_the_same(tmp_path, release):
    report, result = run(tmp_path, "cuda_train.py", release=release, IMPORT_BRIDGE_FIRST="1", PLACEMENT="1")
    assert rows(report)["gpu_migration"]["figures"]["switched_on_by"] == "autogaudi"
    assert report["backend"]["name"] == "hpu"
    assert devices(result) == {"parameters": "4 of 4", "batches": "28 of 28"}


def test_enable_after_torch_loaded_the_bridge_says_what_it_could_not_do_and_the_fix(tmp_path):
    report, _ = run(tmp_path, "cuda_train.py", entry="after_torch")
    units = rows(report)
    migration = units["gpu_migration"]
    assert migration["reason_code"] == "bridge_loaded_first"
    assert "cuda_asked_at_run_time" in migration["note_codes"]
    assert [advice["code"] for advice in migration["recommendations"]] == ["enable_before_torch", "set_variable"]
    for name in DEVICE_UNITS:
        assert stepped_aside(units, name), name


def test_enable_after_torch_on_a_release_that_does_not_autoload_still_migrates(tmp_path):
    report, _ = run(tmp_path, "cuda_train.py", release="1.19", entry="after_torch")
    assert rows(report)["gpu_migration"]["figures"]["switched_on_by"] == "autogaudi"


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
