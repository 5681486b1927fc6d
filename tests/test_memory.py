"""Remembered decisions: a second run with the same script, model and inputs follows the first's
profile and trials without measuring them again, checks its steps against them, and ignores an entry
it cannot trust. The runs' trials time every step alike (tests/scripts/steady_trial_steps.py): a
trial rejects, a check matches the time its trial measured, on a loaded machine as on an idle one."""

import json

import pytest

from tests.helpers import SCRIPTS, clean_env, run_python
from tests.optimizations.ddp_helpers import TORCHRUN, torchrun

CONV = SCRIPTS / "train_conv.py"
STEADY = SCRIPTS / "steady_trial_steps.py"


def run(tmp_path, name, *options, steps=60):
    report = tmp_path / f"{name}.json"
    result = run_python(
        STEADY,
        "--cache-dir",
        tmp_path / "cache",
        "--report",
        report,
        *options,
        CONV,
        env=clean_env(AUTOGAUDI_NO_CACHE="0", STEPS=steps),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(report.read_text()), result.stdout


def unit(report, name):
    return next(row for row in report["units"] if row["name"] == name)


def entry_paths(tmp_path):
    return sorted((tmp_path / "cache" / "decisions").glob("*/*.json"))


def rewrite_entry(tmp_path, change):
    (path,) = entry_paths(tmp_path)
    entry = json.loads(path.read_text())
    change(entry)
    path.write_text(json.dumps(entry))


def test_a_second_run_follows_the_first_runs_profile_and_trial_without_measuring_them(tmp_path):
    first, first_output = run(tmp_path, "first", "--trial", "channels_last")
    second, second_output = run(tmp_path, "second", "--trial", "channels_last")
    assert [record.get("check") for record in first["trials"]] == [None]  # the A/B trial
    assert first["trials"][0]["decision"] == "rejected"  # no arm faster
    assert unit(second, "step_profiler")["reason_code"] == "remembered_profile"
    assert unit(second, "step_profiler")["figures"]["bound"] == unit(first, "step_profiler")["figures"]["bound"]
    assert "ops_per_step" in unit(second, "step_profiler")["figures"]
    # No census step ran: the profile was published at the first step after warm-up and identification.
    assert unit(second, "step_profiler")["figures"]["profiled_at_step"] == 4
    (check,) = second["trials"]  # a check that matches is all there is: no trial of its own
    assert check["check"] == "remembered" and check["arm"] == "without" and check["decision"] == "matches"
    row = unit(second, "channels_last")  # the unit says whose decision it follows
    assert row["reason_code"] == "remembered"
    assert row["reason_params"]["decision"] == "rejected" and row["reason_params"]["run"] == 1
    assert second["cache"]["decisions"].startswith("taken from the 1 earlier run")
    assert first_output == second_output  # the script's own output is unchanged (same final loss)
    (path,) = entry_paths(tmp_path)
    assert json.loads(path.read_text())["runs"] == 2


def test_a_remembered_kept_decision_is_applied_without_a_trial(tmp_path):
    run(tmp_path, "first", "--trial", "channels_last")
    rewrite_entry(tmp_path, lambda entry: entry["trials"]["channels_last"].update(decision="kept"))
    second, _ = run(tmp_path, "second", "--trial", "channels_last")
    row = unit(second, "channels_last")
    (check,) = second["trials"]
    assert check["check"] == "remembered" and check["arm"] == "with" and check["decision"] == "matches"
    assert row["reason_code"] == "remembered" and row["reason_params"]["decision"] == "kept"
    assert row["status"] == "applied" and "run 1's trial" in row["changes"][0]


def test_a_step_time_that_differs_from_the_remembered_one_starts_a_trial(tmp_path):
    run(tmp_path, "first", "--trial", "channels_last")
    rewrite_entry(tmp_path, lambda entry: entry["trials"]["channels_last"].update(ms_per_step_without=1e-4))
    second, _ = run(tmp_path, "second", "--trial", "channels_last")
    check, trial = second["trials"]
    assert check["decision"] == "differs" and check["ratio"] > 100
    assert "check" not in trial and trial["decision"] == "rejected"
    assert unit(second, "channels_last")["reason_code"] == "rejected"
    (path,) = entry_paths(tmp_path)
    assert json.loads(path.read_text())["trials"]["channels_last"]["run"] == 2  # decided again, in run 2


def test_an_unreadable_entry_is_ignored_with_a_note(tmp_path):
    run(tmp_path, "first", "--trial", "channels_last")
    (path,) = entry_paths(tmp_path)
    path.write_text('{"format": 1, "trials": ')
    second, _ = run(tmp_path, "second", "--trial", "channels_last")
    assert unit(second, "step_profiler")["reason_code"] != "remembered_profile"
    assert [record.get("check") for record in second["trials"]] == [None]  # measured again
    assert any("could not be read" in note for note in second["cache"]["notes"])
    assert json.loads(path.read_text())["runs"] == 1  # replaced by this run's decisions


def test_an_entry_of_another_autogaudi_version_is_ignored_with_a_note(tmp_path):
    run(tmp_path, "first", "--trial", "channels_last")
    rewrite_entry(tmp_path, lambda entry: entry["setup"].update(autogaudi="0.0.1"))
    second, _ = run(tmp_path, "second", "--trial", "channels_last")
    assert unit(second, "step_profiler")["reason_code"] != "remembered_profile"
    assert any("another set-up" in note for note in second["cache"]["notes"])


def test_options_that_steer_decisions_are_part_of_the_key_and_the_others_are_not(tmp_path):
    run(tmp_path, "first", "--trial", "channels_last")
    other, _ = run(tmp_path, "other", "--trial", "channels_last", "--warmup-steps", "4")
    assert unit(other, "step_profiler")["reason_code"] != "remembered_profile"
    assert len(list((tmp_path / "cache" / "decisions").iterdir())) == 2  # one set-up folder per option set
    quiet, _ = run(tmp_path, "quiet", "--trial", "channels_last", "--quiet")
    assert unit(quiet, "step_profiler")["reason_code"] == "remembered_profile"


@pytest.mark.slow
def test_on_two_ranks_rank_zero_remembers_and_every_rank_follows_it(tmp_path):
    script = str(SCRIPTS / "ddp_train.py")
    # Rank 0 host-bound: graph_capture's trial waits for a step the run never reaches, so the run ends
    # with a decision open and its model gone (it lives in main()); what it decided is written anyway.
    env = {"AUTOGAUDI_NO_CACHE": "0", "STEPS": "30", "SLOW_HOST_RANK": "0"}
    _, plain_ranks = torchrun(tmp_path, *TORCHRUN, script, env={"STEPS": "30", "SLOW_HOST_RANK": "0"})
    for run_index in (1, 2):
        report = tmp_path / f"report{run_index}.json"
        launch = ("-m", "autogaudi", "--cache-dir", tmp_path / "cache", "--report", report, *TORCHRUN, script)
        result, ranks = torchrun(tmp_path, *launch, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        for rank in ranks:  # the same training as plain DDP, remembered or not
            assert rank["checksum"] == pytest.approx(plain_ranks[0]["checksum"], rel=1e-5)
    assert len(entry_paths(tmp_path)) == 1  # rank 0's only
    report = json.loads((tmp_path / "report2.json").read_text())
    for rank_rows in report["ranks"].values():
        row = unit({"units": rank_rows}, "step_profiler")
        assert row["reason_code"] == "remembered_profile", (row, report["cache"], result.stderr[-2000:])
    # 2, or more where run_ranks ran a job again after gloo's teardown abort (tests/helpers.py)
    assert json.loads(entry_paths(tmp_path)[0].read_text())["runs"] >= 2


def test_precision_auto_remembers_its_speed_trial_and_still_guards_every_run(tmp_path):
    focus = ("--precision", "auto", "--disable", "channels_last,graph_capture")
    first, _ = run(tmp_path, "first", *focus, steps=90)
    (trial,) = [record for record in first["trials"] if record["candidate"] == "mixed_precision"]
    assert trial["decision"] == "rejected"
    second, _ = run(tmp_path, "second", *focus, steps=90)
    (check,) = second["trials"]
    assert check["candidate"] == "mixed_precision" and check["check"] == "remembered"
    assert check["decision"] == "matches" and unit(second, "mixed_precision")["reason_params"]["run"] == 1
    assert "guard_s" not in unit(second, "mixed_precision")["figures"]  # rejected: nothing was set up
    rewrite_entry(tmp_path, lambda entry: entry["trials"]["mixed_precision"].update(decision="kept"))
    third, _ = run(tmp_path, "third", *focus, steps=90)
    assert third["trials"][0]["decision"] == "matches"
    assert "guard_s" in unit(third, "mixed_precision")["figures"]  # kept: numerics checked again first


def test_a_remembered_kept_capture_is_set_up_at_once_and_compiles_from_the_cache(tmp_path):
    focus = ("--trial", "graph_capture", "--disable", "channels_last")
    first, _ = run(tmp_path, "first", *focus)
    assert [record["candidate"] for record in first["trials"]] == ["graph_capture"]
    rewrite_entry(tmp_path, lambda entry: entry["trials"]["graph_capture"].update(decision="kept"))
    second, second_output = run(tmp_path, "second", *focus)
    row = unit(second, "graph_capture")
    (check,) = second["trials"]  # kept without a trial of its own
    assert check["check"] == "remembered" and check["arm"] == "with" and check["decision"] == "matches"
    assert row["figures"]["compile_cache"] == "hit"  # the first run's trial compiled it into the cache
    assert row["reason_code"] == "remembered" and row["status"] == "applied"
    assert "run 1's trial" in row["changes"][0] and "compiled from the cache" in row["changes"][0]
    assert second_output.startswith("loss ")
