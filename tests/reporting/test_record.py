"""The exit report: a short summary on stderr (the table with --verbose), JSON on request, quiet,
rank 0 only; the launcher always reports."""

import json
import re

import pytest
import torch

from tests.helpers import REPO, SCRIPTS, bare_report, clean_env, plain_run, run_python

BACKEND = "cuda" if torch.cuda.is_available() else "cpu"  # what a launcher run picks on this machine


def test_launcher_prints_the_table_and_writes_json(tmp_path):
    path = tmp_path / "report.json"
    result = run_python("-m", "autogaudi", "--verbose", "--report", path, SCRIPTS / "train_tiny.py")
    assert result.returncode == 0, result.stderr
    plain = plain_run(SCRIPTS / "train_tiny.py")
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
    assert re.search(r"  run      0 training steps(;|\n)", result.stderr)  # then its start's cost, if any


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
    result = run_python(
        "-m", "autogaudi", "--force", "fused_optimizer", "--report", path, SCRIPTS / "train_tiny.py",
        env=clean_env(MODEL="mlp"),
    )  # fmt: skip
    lines = result.stderr.splitlines()
    assert re.match(r"^autogaudi .* report \(torch", lines[0]) and len(lines) <= 10, result.stderr
    assert [line[:11] for line in lines[1:3]] == ["  run      ", "  changed  "]
    assert not any(line.startswith("  unit ") for line in lines)
    summary = json.loads(path.read_text())["summary"]
    assert summary["steps"] == 10 and summary["seconds"] > 0
    (change,) = [change for change in summary["changed"] if change["unit"] == "fused_optimizer"]
    # forced: in force from the first step, untimed; the report says what it changed
    assert change["effect"] is None or change["effect"]["one_off_s"] == 0


def test_the_report_leads_with_what_autogaudi_changed(tmp_path):
    path = tmp_path / "report.json"
    result = run_python(
        "-m", "autogaudi", "--verbose", "--force", "fused_optimizer", "--report", path, SCRIPTS / "train_tiny.py",
        env=clean_env(MODEL="mlp"),
    )  # fmt: skip
    report = json.loads(path.read_text())
    changed = {row["unit"] for row in report["changed"]}
    assert "fused_optimizer" in changed  # its AdamW fused from the first step (forced: untimed)
    assert "step_profiler" not in changed and "throughput_meter" not in changed  # they only measure
    applied = {unit["name"] for unit in report["units"] if unit["changes"]}
    assert applied == changed
    # "applied" only where something changed; the rest of the units in force watch or were not needed.
    # A change still measured at exit (the fused update timed for longer on a loaded machine) reads deciding.
    status = {unit["name"]: unit["status"] for unit in report["units"]}
    assert {name for name, word in status.items() if word == "applied"} <= changed
    assert {status[name] for name in changed} <= {"applied", "deciding"}
    assert status["throughput_meter"] == status["ddp_tuning"] == "watching"  # measuring; no DDP model came
    # channels_last decides on the step profile: whether three census pairs settle it within 10 steps
    # is the machine's timing; either way its row follows the profile (an MLP: no Conv2d to convert).
    units = {unit["name"]: unit for unit in report["units"]}
    profiled = "profiled_at_step" in units["step_profiler"]["figures"]
    assert (status["channels_last"], units["channels_last"]["reason_code"]) == (
        ("not needed", "no_conv2d") if profiled else ("watching", "waiting_for_profile")
    )
    assert report["schema"] == 4
    lines = result.stderr.splitlines()
    headline = next(index for index, line in enumerate(lines) if line.startswith("  changed  "))
    assert headline < next(index for index, line in enumerate(lines) if line.startswith("  unit "))


def test_a_unit_that_decided_nothing_needs_changing_says_not_needed(tmp_path):
    path = tmp_path / "report.json"
    result = run_python("-m", "autogaudi", "--verbose", "--report", path, REPO / "examples" / "train_mnist_mlp.py")
    status = {unit["name"]: unit["status"] for unit in json.loads(path.read_text())["units"]}
    assert status["channels_last"] == "not needed"  # profiled: no Conv2d in the training model
    assert status["step_profiler"] == "watching"
    assert re.search(r"  channels_last +not needed ", result.stderr)  # the same words in the table


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
        {"name": "fused_optimizer", "changes": ["fused"], "numerics": ["rounding"], "numerics_measured": measured},
        {
            "name": "graph_capture",
            "changes": ["captured"],
            "numerics": ["rounding", "random"],
            "numerics_measured": None,
        },
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


def trial(candidate, without, with_, decision, spreads=None, one_off=0.5, started_at=5):
    """A trial's record as autogaudi.measure.trials writes it (``spreads``: each arm's, where measured)."""
    record = {
        "candidate": candidate,
        "ms_per_step_with": with_,
        "ms_per_step_without": without,
        "speedup": round(without / with_, 3),
        "one_off_s": one_off,
        "set_up_s": 0.0,
        "steps": 21,
        "decision": decision,
        "started_at_step": started_at,
        "arms": [["without", 3], ["warm-up", 3], ["with", 3], ["without", 6], ["with", 6]],
    }
    if spreads is not None:
        record["spread_with"], record["spread_without"] = spreads
    return record


def kept_row(name):
    return {"name": name, "changes": [f"{name} on"], "numerics": [], "figures": {}}


def summary_of(report):
    return report.as_dict()["summary"]


def line(report, label):
    (found,) = [line for line in report.format().splitlines() if line.startswith(f"  {label}")]
    return found


def test_a_speedup_carries_its_spread_and_a_saving_within_noise_is_not_claimed():
    """Two identical runs read 1.09x and 1.19x: the same gain of 4 ms in 100 with 10% noise per arm
    is no saving to claim; with 1% noise per arm it is, with its ±."""
    noisy = bare_report(
        units=[kept_row("graph_capture")],
        trials=[trial("graph_capture", 100.0, 96.0, "kept", spreads=(0.1, 0.1))],
        steps={"steps": 200},
    )
    (change,) = summary_of(noisy)["changed"]
    assert change["effect"]["claimed"] is False and change["effect"]["spread"] == pytest.approx(0.141, abs=1e-3)
    assert "1.042x ±14%" in line(noisy, "changed") and "no saving claimed" in line(noisy, "changed")
    assert "saved" not in line(noisy, "changed") and "within noise" in line(noisy, "run")
    steady = bare_report(
        units=[kept_row("graph_capture")],
        trials=[trial("graph_capture", 100.0, 96.0, "kept", spreads=(0.01, 0.01), one_off=0.1)],
        steps={"steps": 200},
    )
    effect = summary_of(steady)["changed"][0]["effect"]
    assert effect["claimed"] is True and effect["saved_s"] > effect["noise_s"] > 0
    assert f"±{effect['noise_s']} s saved" in line(steady, "changed")


def test_without_a_spread_the_figure_stands_as_measured_with_no_plus_minus():
    report = bare_report(
        units=[kept_row("graph_capture")], trials=[trial("graph_capture", 100.0, 80.0, "kept")], steps={"steps": 100}
    )
    effect = summary_of(report)["changed"][0]["effect"]
    assert (effect["spread"], effect["noise_s"], effect["claimed"]) == (None, None, True)
    assert "±" not in line(report, "changed") and "(1.25x)" in line(report, "changed")


def test_the_run_line_sets_autogaudis_own_cost_against_what_the_kept_changes_saved():
    """A kept change saved 20 ms over 80 steps net of its 0.5 s one-off; a rejected trial paid its
    one-off and its slower "with" arm: the whole run is what both make together, not the speed-up."""
    report = bare_report(
        units=[kept_row("graph_capture"), {"name": "channels_last", "numerics": [], "figures": {}}],
        trials=[
            trial("graph_capture", 100.0, 80.0, "kept", started_at=5),
            trial("channels_last", 80.0, 90.0, "rejected", one_off=1.0, started_at=30),
        ],
        steps={"steps": 100},
    )
    whole = summary_of(report)["whole_run"]
    steps_with = 100 - 5 - 9  # the kept trial's "without" steps ran as plain
    saved = 0.020 * steps_with
    rejected_cost = 1.0 + 0.010 * 9
    assert whole["cost_s"] == pytest.approx(0.5 + rejected_cost)
    assert whole["net_s"] == pytest.approx(saved - 0.5 - rejected_cost)
    assert "autogaudi's own cost" in line(report, "run") and "against plain: " in line(report, "run")


def test_autogaudis_start_exit_and_per_call_work_are_its_own_cost_against_plain():
    """Nothing changed, but autogaudi started, its wrappers ran in the user's calls and its exit built
    the report: a run slower than plain by that much, and the run line says so with the parts."""
    timeline = {"every": 1, "step_s": [0.01] * 100, "start_up_s": 0.05, "per_call_s": 0.02, "exit_s": 0.01}
    report = bare_report(steps={"steps": 100}, timeline=timeline)
    whole = summary_of(report)["whole_run"]
    assert (whole["start_up_s"], whole["per_call_s"], whole["exit_s"]) == (0.05, 0.02, 0.01)
    assert whole["cost_s"] == pytest.approx(0.08) and whole["net_s"] == pytest.approx(-0.08)
    # the per-call work ran inside the steps; the start and the exit did not
    assert whole["plain_s"] == pytest.approx(1.0 - 0.02)
    assert "start 0.05 s, exit 0.01 s, per-call work 0.02 s" in line(report, "run")


ROLLOUT = """
import torch
from torch import nn
policy = nn.Linear(4, 2)
optimizer = torch.optim.SGD(policy.parameters(), lr=0.01)
for _ in range(3):
    for _ in range(8):
        with torch.no_grad():
            policy(torch.randn(1, 4))
    for _ in range(4):
        policy(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
"""


def test_a_launched_run_reports_its_start_and_the_evaluation_watchs_time_as_its_own(tmp_path):
    script, out = tmp_path / "rollout.py", tmp_path / "report.json"
    script.write_text(ROLLOUT)
    result = run_python("-m", "autogaudi", "--quiet", "--only", "throughput_meter", "--report", out, script)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    timeline, whole = report["timeline"], report["summary"]["whole_run"]
    assert timeline["start_up_s"] > 0 and timeline["per_call_s"] > 0 and timeline["exit_s"] > 0
    assert whole["cost_s"] >= whole["start_up_s"] + whole["per_call_s"] + whole["exit_s"] - 0.002


def test_where_a_change_was_not_timed_the_run_line_gives_the_cost_and_no_ratio():
    report = bare_report(
        units=[kept_row("fused_optimizer"), {"name": "channels_last", "numerics": [], "figures": {}}],
        trials=[trial("channels_last", 80.0, 90.0, "rejected", one_off=1.0)],
        steps={"steps": 100},
    )
    whole = summary_of(report)["whole_run"]
    assert (whole["net_s"], whole["plain_s"]) == (None, None) and whole["cost_s"] > 0
    assert "against plain: not known (fused_optimizer" in line(report, "run")


def test_a_forced_unit_that_switched_itself_off_is_named_with_why():
    row = {
        "name": "graph_capture",
        "numerics": [],
        "figures": {},
        "reason": "switched off: dynamic shapes, 9 distinct input shapes",
        "reason_code": "dynamic_shapes",
    }
    report = bare_report(units=[row], options={"force": ["graph_capture"]})
    assert summary_of(report)["forced_off"] == [
        {"unit": "graph_capture", "reason_code": "dynamic_shapes", "reason": row["reason"]}
    ]
    assert "graph_capture: switched off: dynamic shapes" in line(report, "forced")


def test_a_unit_put_back_is_not_named_as_having_changed_the_results():
    row = {"name": "fused_optimizer", "changes": [], "numerics": ["rounding"], "numerics_measured": None}
    report = bare_report(units=[row])
    results = line(report, "results")
    assert "fused_optimizer's timed steps only" in results and "not kept" in results
    assert "changed  nothing" in report.format()


def test_evaluation_passes_counted_only_in_the_first_steps_say_so_with_the_count():
    steps = {"steps": 50, "evaluation_forward_passes": 30, "evaluation_counted_until_step": 10}
    run = line(bare_report(steps=steps), "run")
    assert "30 evaluation forward passes counted in the first 10 steps, none after" in run
    assert run.count("evaluation forward passes") == 1


def test_a_change_timed_on_its_own_part_counts_its_measuring_steps_as_autogaudis_cost():
    """A fused optimizer's timed steps also ran the fused update on copies: 4 of 1 ms. It saves 2 ms
    in each step after them (100 less its first and its 4 timed ones)."""
    row = {**kept_row("fused_optimizer"), "figures": {"update_ms": {"unfused": 3.0, "fused": 1.0, "steps": 4}}}
    report = bare_report(units=[row], steps={"steps": 100, "steps_per_s": 100.0})
    whole = summary_of(report)["whole_run"]
    assert (whole["measuring_s"], whole["cost_s"]) == (0.004, 0.004)
    assert whole["net_s"] == pytest.approx(0.002 * 95 - 0.004)
    assert "measuring 0.004 s" in line(report, "run")


def test_a_loader_given_workers_is_credited_against_the_runs_own_steps_not_its_window_with_workers():
    """The window with workers read 20 ms a batch; the run's steps, which also start and stop each
    epoch's workers, averaged 25 ms: the 90 steps after batch 10 saved 30 - 25 ms each, not 30 - 20."""
    figures = {"ms_per_batch_before": 30.0, "ms_per_batch_after": 20.0, "loaders_tuned": 1, "workers_from_batch": 10}
    row = {**kept_row("loader_workers"), "figures": figures}
    effect = summary_of(bare_report(units=[row], steps={"steps": 100, "steps_per_s": 40.0}))["changed"][0]["effect"]
    assert (effect["ms_per_step_without"], effect["ms_per_step_with"]) == (30.0, 25.0)
    assert effect["saved_s"] == pytest.approx(0.005 * 90)


@pytest.mark.parametrize("noise_ms, claimed", [(2.0, True), (6.0, False)])
def test_a_loaders_saving_within_its_windows_noise_is_not_claimed(noise_ms, claimed):
    """5 ms a step over 90 steps, its windows' rounds scattering by ``noise_ms`` together: the saving is
    stated with its noise (0.18 s), or, where the noise (0.54 s) is larger, within noise and unclaimed."""
    figures = {
        "ms_per_batch_before": 30.0,
        "ms_per_batch_after": 20.0,
        "ms_per_batch_noise": noise_ms,
        "loaders_tuned": 1,
        "workers_from_batch": 10,
    }
    report = bare_report(
        units=[{**kept_row("loader_workers"), "figures": figures}], steps={"steps": 100, "steps_per_s": 40.0}
    )
    effect = summary_of(report)["changed"][0]["effect"]
    assert (effect["noise_s"], effect["claimed"]) == (pytest.approx(noise_ms / 1000 * 90), claimed)
    assert ("within noise" in line(report, "changed")) is not claimed


def test_a_part_timed_and_put_back_still_counts_its_measuring_steps_as_autogaudis_cost():
    """The fused update timed slower and not used: its timed steps ran both updates all the same."""
    figures = {"update_ms": {"unfused": 3.0, "fused": 5.0, "steps": 4}, "optimizers_put_back": 1}
    row = {"name": "fused_optimizer", "changes": [], "numerics": [], "figures": figures}
    whole = summary_of(bare_report(units=[row], steps={"steps": 100, "steps_per_s": 100.0}))["whole_run"]
    assert (whole["measuring_s"], whole["cost_s"]) == (0.02, 0.02)
