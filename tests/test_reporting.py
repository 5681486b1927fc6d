"""The exit report: a short summary on stderr (the table with --verbose), JSON on request, quiet,
rank 0 only; the launcher always reports."""

import json
import re

import torch

from tests.helpers import REPO, SCRIPTS, bare_report, clean_env, run_python

BACKEND = "cuda" if torch.cuda.is_available() else "cpu"  # what a launcher run picks on this machine


def test_launcher_prints_the_table_and_writes_json(tmp_path):
    path = tmp_path / "report.json"
    result = run_python("-m", "autogaudi", "--verbose", "--report", path, SCRIPTS / "train_tiny.py")
    assert result.returncode == 0, result.stderr
    plain = run_python(SCRIPTS / "train_tiny.py")
    assert result.stdout == plain.stdout  # the report never touches the script's own output
    report = json.loads(path.read_text())
    assert report["backend"]["name"] == BACKEND
    assert report["enabled_by"] == ["launcher"]
    assert report["steps"]["optimizer_steps"] == 10
    # 3 warm-up steps of 10: the other 7 are timed
    assert report["steps"]["timed_steps"] == 7 and report["steps"]["steps_per_s"] > 0
    row = {unit["name"]: unit for unit in report["units"]}["step_marks"]
    assert (row["status"], row["reason_code"], row["reason_params"]["backends"]) == ("skipped", "other_backend", "hpu")
    assert "hpu: habana_frameworks.torch is not installed" in report["backend"]["reason"]
    for line in (f"backend  {BACKEND}:", "10 optimizer steps, 10 backward passes"):
        assert line in result.stderr
    assert re.search(r"  step_marks +skipped", result.stderr)  # padded to the longest unit name


def test_quiet_keeps_stderr_clean_but_still_writes_json(tmp_path):
    path = tmp_path / "report.json"
    result = run_python("-m", "autogaudi", "--quiet", "--report", path, SCRIPTS / "train_tiny.py")
    assert (result.returncode, result.stderr) == (0, "")
    assert json.loads(path.read_text())["options"]["quiet"] is True


def test_launcher_reports_even_without_training():
    result = run_python("-m", "autogaudi", SCRIPTS / "train_tiny.py", env=clean_env(TRAIN="0"))
    assert "  run      0 training steps\n" in result.stderr


def test_only_rank_zero_reports(tmp_path):
    path = tmp_path / "report.json"
    result = run_python("-m", "autogaudi", "--report", path, SCRIPTS / "train_tiny.py", env=clean_env(RANK="1"))
    assert (result.returncode, result.stderr) == (0, "")
    assert not path.exists()


def test_log_every_prints_progress_lines():
    result = run_python("-m", "autogaudi", "--log-every", "5", "--quiet", SCRIPTS / "train_tiny.py")
    progress = [line for line in result.stderr.splitlines() if line.startswith("autogaudi: step")]
    assert [line.split(" | ")[0] for line in progress] == ["autogaudi: step 5", "autogaudi: step 10"]
    assert "steps/s" in progress[1] and "mem" in progress[1]


def test_the_default_report_is_short_and_says_what_changed_and_its_effect(tmp_path):
    """A person reads it in five seconds: the header (CI greps it), the run, each change with what
    it did to the run's steps, and nothing of the per-unit table, which --verbose and the JSON keep."""
    path = tmp_path / "report.json"
    result = run_python("-m", "autogaudi", "--report", path, SCRIPTS / "train_tiny.py", env=clean_env(MODEL="mlp"))
    lines = result.stderr.splitlines()
    assert re.match(r"^autogaudi .* report \(torch", lines[0]) and len(lines) <= 10, result.stderr
    assert [line[:11] for line in lines[1:3]] == ["  run      ", "  changed  "]
    assert not any(line.startswith("  unit ") for line in lines)
    summary = json.loads(path.read_text())["summary"]
    assert summary["steps"] == 10 and summary["seconds"] > 0
    (change,) = [change for change in summary["changed"] if change["unit"] == "fused_optimizer"]
    # in force from the first step: its effect is its update timed against torch's unfused one
    assert change["effect"]["timed"].startswith("the update alone") and change["effect"]["one_off_s"] == 0


def test_the_report_leads_with_what_autogaudi_changed(tmp_path):
    path = tmp_path / "report.json"
    result = run_python(
        "-m", "autogaudi", "--verbose", "--report", path, SCRIPTS / "train_tiny.py", env=clean_env(MODEL="mlp")
    )
    report = json.loads(path.read_text())
    changed = {row["unit"] for row in report["changed"]}
    assert "fused_optimizer" in changed  # its AdamW's fused update measured faster: kept
    assert "step_profiler" not in changed and "throughput_meter" not in changed  # they only measure
    applied = {unit["name"] for unit in report["units"] if unit["changes"]}
    assert applied == changed
    # "applied" only where something changed; the rest of the units in force watch or were not needed
    status = {unit["name"]: unit["status"] for unit in report["units"]}
    assert {name for name, word in status.items() if word == "applied"} == changed
    assert status["throughput_meter"] == status["ddp_tuning"] == "watching"  # measuring; no DDP model came
    assert status["channels_last"] == "watching"  # 10 steps: the step profile it decides on is not taken yet
    assert report["schema"] == 3
    lines = result.stderr.splitlines()
    headline = next(index for index, line in enumerate(lines) if line.startswith("  changed  "))
    assert headline < next(index for index, line in enumerate(lines) if line.startswith("  unit "))


def test_a_unit_that_decided_nothing_needs_changing_says_not_needed(tmp_path):
    path = tmp_path / "report.json"
    result = run_python("-m", "autogaudi", "--verbose", "--report", path, REPO / "examples" / "train_mnist_mlp.py")
    status = {unit["name"]: unit["status"] for unit in json.loads(path.read_text())["units"]}
    assert status["channels_last"] == "not needed"  # profiled: no Conv2d in the training model
    assert status["fused_optimizer"] == "applied" and status["step_profiler"] == "watching"
    assert re.search(r"  channels_last +not needed ", result.stderr)  # the same words in the table


def test_a_trial_held_back_until_the_run_could_pay_for_it_is_what_comes_next():
    """A host-bound run too short for a capture's one-off: the short report says what a longer run
    would try, not that nothing was measured to try."""
    profile = {"name": "step_profiler", "status": "watching", "figures": {"bound": "host"}}
    waiting = {
        "name": "graph_capture",
        "status": "watching",
        "reason_code": "trial_waits",
        "figures": {"trial_waits_for_step": 5715},
    }
    lines = bare_report(units=[profile, waiting]).format(verbose=False).splitlines()
    (next_line,) = [line for line in lines if line.startswith("  next")]
    assert next_line.startswith("  next     graph_capture: a trial waits for step 5715")
    started = {**waiting, "reason_code": "trial_running"}
    lines = bare_report(units=[profile, started]).format(verbose=False).splitlines()
    assert [line for line in lines if line.startswith("  next")] == [
        "  next     nothing measured to try: the step is host-bound (--verbose: by how much)"
    ]


def test_nothing_changed_is_said_so(tmp_path):
    result = run_python("-m", "autogaudi", "--only", "step_profiler", SCRIPTS / "train_tiny.py")
    assert "  changed  nothing (--verbose says why for each unit)" in result.stderr


def test_the_table_shows_a_remembered_decisions_check_and_the_cache_line():
    report = bare_report(
        trials=[
            {
                "candidate": "graph_capture",
                "check": "remembered",
                "arm": "without",
                "ms_per_step": 1.0,
                "ms_per_step_remembered": 1.1,
                "ratio": 0.909,
                "steps": 9,
                "decision": "matches",
            }
        ],
        cache={
            "dir": "/c",
            "decisions": "measured in this run",
            "compile": {"TORCHINDUCTOR_CACHE_DIR": {"value": "/c/compile/inductor", "set_by": "autogaudi"}},
            "notes": ["ignored a cache entry that could not be read: /c/x.json"],
        },
    )
    text = report.format(verbose=True)
    assert (
        "trial    graph_capture: 1.0 ms/step without it, against 1.1 remembered (0.909x) over 9 steps -> matches"
        in text
    )
    assert "cache    /c: decisions measured in this run; compile caches kept there (TORCHINDUCTOR_CACHE_DIR)" in text
    assert "note: ignored a cache entry that could not be read: /c/x.json" in text
    assert report.as_dict()["cache"]["compile"]["TORCHINDUCTOR_CACHE_DIR"]["set_by"] == "autogaudi"


def test_a_cache_folder_that_could_not_be_used_says_so():
    report = bare_report(
        cache={"dir": None, "decisions": "not remembered", "compile": {}, "notes": []},
    )
    assert "  cache    not used: decisions not remembered" in report.format(verbose=True)


def test_the_results_line_gives_each_units_measured_size_or_says_it_was_not_measured():
    measured = {"max_rel_diff": 2.4e-07, "of": "parameters", "steps": 3, "against": "torch's unfused step"}
    rows = [
        {"name": "fused_optimizer", "numerics": ["rounding"], "numerics_measured": measured},
        {"name": "graph_capture", "numerics": ["rounding", "random"], "numerics_measured": None},
        {"name": "step_profiler", "numerics": [], "numerics_measured": None, "figures": {}},
    ]
    report = bare_report(units=rows)
    assert report.as_dict()["numerics"] == [
        {"unit": "fused_optimizer", "how": ["rounding"], "measured": measured},
        {"unit": "graph_capture", "how": ["rounding", "random"], "measured": None},
    ]
    (line,) = [line for line in report.format().splitlines() if line.startswith("  results")]
    assert line == (
        "  results  may differ from plain: fused_optimizer (rounding, parameters ≤2.4e-07 relative per step, "
        "measured), graph_capture (rounding, random, not measured)"
    )
