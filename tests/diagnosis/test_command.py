"""The doctor: one script per finding kind under tests/diagnosis/scripts, each marking the line the
finding must point at with ``# doctor: <kind>``; a clean script yields none; the script stops
after N steps and computes exactly what it computes without the doctor."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.nn.modules.module import register_module_forward_hook

import autogaudi
from autogaudi.diagnosis.findings import KINDS, SCHEMA
from tests.helpers import run_python

SCRIPTS = Path(__file__).parent / "scripts"


def marked_lines(script: Path) -> dict:
    """{"host_sync item": line, ...} from the ``# doctor: ...`` markers of a script."""
    return {
        line.split("# doctor:")[1].strip(): number
        for number, line in enumerate(script.read_text().splitlines(), 1)
        if "# doctor:" in line
    }


def diagnose(name: str, *args, steps=8):
    return autogaudi.doctor(str(SCRIPTS / name), *args, steps=steps)


def only(diagnosis, kind: str) -> list:
    return [finding for finding in diagnosis.findings if finding.kind == kind]


def at_line(finding, script: str, marker: str) -> bool:
    return finding.location == (str(SCRIPTS / script), marked_lines(SCRIPTS / script)[marker])


def test_a_clean_script_has_no_findings():
    diagnosis = diagnose("clean.py")
    assert diagnosis.steps_run == 8 and diagnosis.outcome == "stopped"
    assert diagnosis.findings == [], diagnosis.format()


def test_host_syncs_are_found_where_they_are_with_their_rate(tmp_path):
    diagnosis = diagnose("host_sync.py", str(tmp_path / "done"))
    reads = {finding.evidence["read"]: finding for finding in only(diagnosis, "host_sync")}
    assert set(reads) == {"item", "condition", "tolist"}, diagnosis.format()
    for read, finding in reads.items():
        assert at_line(finding, "host_sync.py", f"host_sync {read}")
        assert finding.evidence["reads_per_step"] == 1.0 and finding.severity == "high"
    assert not only(diagnosis, "graph_blocker")  # the reads are in the loop, not in forward


def test_control_flow_on_a_tensor_inside_forward_is_a_graph_blocker():
    (finding,) = only(diagnose("graph_blocker.py"), "graph_blocker")
    assert at_line(finding, "graph_blocker.py", "graph_blocker")
    assert finding.evidence["read"] == "condition" and finding.evidence["reads_per_step"] == 1.0


def test_boolean_mask_indexing_is_a_dynamic_op():
    (finding,) = only(diagnose("dynamic_ops.py"), "dynamic_ops")
    assert at_line(finding, "dynamic_ops.py", "dynamic_ops")
    assert finding.evidence["op"] == "index with a boolean mask"


def test_changing_input_shapes_predict_recompilations():
    (finding,) = only(diagnose("dynamic_shapes.py", steps=10), "dynamic_shapes")
    assert finding.evidence["distinct_shapes"] == 7  # lengths 5..11 over 10 steps
    assert sorted(shape["shapes"][0][1] for shape in finding.evidence["shapes_seen"]) == list(range(5, 12))
    assert finding.location[0] == str(SCRIPTS / "dynamic_shapes.py")


def test_a_python_number_that_changes_every_step_is_named_where_the_model_is_called():
    diagnosis = diagnose("python_scalar.py")
    (finding,) = only(diagnosis, "python_scalar")
    assert at_line(finding, "python_scalar.py", "python_scalar")
    assert finding.severity == "high" and finding.evidence["argument"] == "args[1]"
    assert finding.evidence["values_seen"] == list(range(8)) and finding.evidence["type"] == "int"
    assert not only(diagnosis, "dynamic_shapes")  # the tensors' shapes never changed


def test_a_short_last_batch_is_named_with_its_size():
    diagnosis = diagnose("last_batch.py", steps=12)  # 7 batches per epoch: the short one was seen
    (finding,) = only(diagnosis, "last_batch")
    assert at_line(finding, "last_batch.py", "last_batch")
    assert finding.evidence == {
        "dataset_length": 100,
        "batch_size": 16,
        "last_batch_size": 4,
        "predicted_recompilations_per_epoch": 1,
    }
    assert finding.fixed_by == "static_last_batch"
    assert not only(diagnosis, "dynamic_shapes")  # the last batch alone is not reported twice


def test_float64_tensors_are_a_cpu_fallback_risk():
    findings = only(diagnose("cpu_fallback.py"), "cpu_fallback")
    (finding,) = [f for f in findings if at_line(f, "cpu_fallback.py", "cpu_fallback")]  # the backward too
    assert finding.evidence["dtype"] == "float64" and finding.evidence["op_calls"] >= 8
    assert "docs.habana.ai" in finding.evidence["facts"]


@pytest.fixture
def forwards_take(monkeypatch, step_clock):
    """The script's dataset sleeps on the step clock instead of the machine's, and each of its
    forwards takes ``seconds`` of it: the doctor judges the times the test gives, whatever the load."""
    monkeypatch.setattr(time, "sleep", step_clock.advance)
    handles = []

    def take(seconds: float) -> None:
        forward = lambda module, args, output: step_clock.advance(seconds)  # noqa: E731
        handles.append(register_module_forward_hook(forward))

    yield take
    for handle in handles:
        handle.remove()


def test_a_slow_dataset_makes_the_run_input_bound(forwards_take):
    forwards_take(0.008)  # 16 items of 2 ms each wait 32 ms a step; the step is 40 ms
    (finding,) = only(diagnose("input_bound.py"), "input_bound")
    assert at_line(finding, "input_bound.py", "input_bound")
    assert finding.evidence == {"input_wait_fraction": 0.8, "step_ms": 40.0, "wait_ms_per_step": 32.0}
    assert finding.severity == "high" and finding.fixed_by == "loader_workers, pin_memory"


def test_a_step_that_computes_more_than_it_waits_is_not_input_bound(forwards_take):
    forwards_take(0.32)  # waiting is 32 ms of a 352 ms step: under the rule's 10%
    assert not only(diagnose("input_bound.py"), "input_bound")


def test_tile_sizes_and_bf16_readiness(step_clock):
    """Every op lasts one tick of the step clock: the bf16 share is that of the forward's ops, two
    products of its six (t, addmm, relu, detach), not of a loaded machine's timings."""
    step_clock.tick = 1e-6
    diagnosis = diagnose("tile_size.py")
    titles = [finding.title for finding in only(diagnosis, "tile_size")]
    assert "batch size 12 is not a multiple of 8" in titles
    layers = next(f.evidence["layers"] for f in only(diagnosis, "tile_size") if "layers" in f.evidence)
    assert layers == ["0 Linear(256, 1000)", "2 Linear(1000, 256)"]
    (precision,) = only(diagnosis, "mixed_precision")
    assert precision.evidence["bf16_share"] == 0.333 and precision.evidence["bf16_ops"] == ["addmm"]


@pytest.mark.slow
def test_the_command_stops_the_script_after_n_steps_without_changing_its_numerics(tmp_path):
    script = SCRIPTS / "host_sync.py"
    plain = run_python(script, tmp_path / "plain")
    assert plain.returncode == 0, plain.stderr
    report = tmp_path / "doctor.json"
    doctored = run_python(
        "-m",
        "autogaudi",
        "doctor",
        "--steps",
        "5",
        "--json",
        report,
        "--fail-on",
        "host_sync",
        script,
        tmp_path / "doctored",
    )
    assert doctored.returncode == 1  # --fail-on host_sync, and there are some
    lines = doctored.stdout.splitlines()
    assert lines == plain.stdout.splitlines()[:5]  # same losses, bit for bit, then nothing more
    assert not (tmp_path / "doctored").exists()  # what comes after the loop never ran
    assert "autogaudi doctor: " in doctored.stderr and "host_sync.py:19" in doctored.stderr
    data = json.loads(report.read_text())
    assert data["schema"] == SCHEMA and data["steps_run"] == 5 and data["outcome"] == "stopped"
    assert {finding["kind"] for finding in data["findings"]} <= set(KINDS)
    assert data["findings"][0]["location"]["line"] in marked_lines(script).values()
    without_gate = subprocess.run(
        [sys.executable, "-m", "autogaudi", "doctor", "--steps", "2", str(script), "x"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert without_gate.returncode == 0  # findings alone do not fail the command


def test_bad_fail_on_kinds_are_named():
    result = subprocess.run(
        [sys.executable, "-m", "autogaudi", "doctor", "--fail-on", "speed", "x.py"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "unknown kind(s) speed; valid: all, host_sync" in result.stderr
