"""Remembered decisions: a second run with the same script, model and inputs follows the first's
profile and trials without measuring them again, checks its steps against them, and ignores an entry
it cannot trust. The runs' trials time every step alike (tests/scripts/steady_trial_steps.py): a
trial rejects, a check matches the time its trial measured, on a loaded machine as on an idle one."""

import json
import pathlib
import shutil

import pytest
from torch import nn

from autogaudi.backends.cpu import CpuBackend
from autogaudi.core.options import Options
from autogaudi.store.cache import Cache
from autogaudi.store.decisions import Memory
from tests.helpers import CORRUPTIONS, SCRIPTS, clean_env, corrupt, run_python
from tests.optimizations.ddp_helpers import PLAIN_TORCHRUN, TORCHRUN, torchrun

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


@pytest.fixture(scope="module")
def channels_last_first_run(tmp_path_factory):
    """The first run of ``--trial channels_last`` the tests below start from, run once for them all:
    its report, its output and the cache it left."""
    folder = tmp_path_factory.mktemp("first")
    report, output = run(folder, "first", "--trial", "channels_last")
    return report, output, folder / "cache"


@pytest.fixture
def after_first_run(tmp_path, channels_last_first_run):
    """``tmp_path/cache`` as that first run left it (a copy of its own): the first run's report and output."""
    report, output, cache = channels_last_first_run
    shutil.copytree(cache, tmp_path / "cache", symlinks=True)
    return report, output


def unit(report, name):
    return next(row for row in report["units"] if row["name"] == name)


def entry_paths(tmp_path):
    return sorted((tmp_path / "cache" / "decisions").glob("*/*.json"))


def rewrite_entry(tmp_path, change):
    (path,) = entry_paths(tmp_path)
    entry = json.loads(path.read_text())
    change(entry)
    path.write_text(json.dumps(entry))


def test_a_second_run_follows_the_first_runs_profile_and_trial_without_measuring_them(tmp_path, after_first_run):
    first, first_output = after_first_run
    second, second_output = run(tmp_path, "second", "--trial", "channels_last")
    assert [record.get("check") for record in first["trials"]] == [None]  # the A/B trial
    assert first["trials"][0]["decision"] == "rejected"  # no arm faster
    assert unit(second, "step_profiler")["reason_code"] == "remembered_profile"
    assert unit(second, "step_profiler")["figures"]["bound"] == unit(first, "step_profiler")["figures"]["bound"]
    assert "ops_per_step" in unit(second, "step_profiler")["figures"]
    # No census step ran: the profile was published at the first step after warm-up and identification.
    assert unit(second, "step_profiler")["figures"]["profiled_at_step"] == 4
    assert second["trials"] == []  # a remembered rejection holds: no trial, no check of it
    row = unit(second, "channels_last")  # the unit says whose decision it follows
    assert row["reason_code"] == "remembered"
    assert row["reason_params"]["decision"] == "rejected" and row["reason_params"]["run"] == 1
    assert second["cache"]["decisions"].startswith("taken from the 1 earlier run")
    assert first_output == second_output  # the script's own output is unchanged (same final loss)
    (path,) = entry_paths(tmp_path)
    assert json.loads(path.read_text())["runs"] == 2


def test_a_remembered_kept_decision_is_applied_without_a_trial(tmp_path, after_first_run):
    """Remembered far slower than any run here takes: this run, quiet or busy, is faster than the keep
    promised, which does not contradict it (only a run clearly slower does, tested below)."""
    rewrite_entry(
        tmp_path, lambda entry: entry["trials"]["channels_last"].update(decision="kept", ms_per_step_with=1e6)
    )
    second, _ = run(tmp_path, "second", "--trial", "channels_last")
    row = unit(second, "channels_last")
    (check,) = second["trials"]
    assert check["check"] == "remembered" and check["arm"] == "with" and check["decision"] == "matches"
    assert row["reason_code"] == "remembered" and row["reason_params"]["decision"] == "kept"
    assert row["status"] == "applied" and "run 1's trial" in row["changes"][0]


@pytest.mark.slow
def test_a_rejection_holds_whatever_this_runs_steps_take(tmp_path, after_first_run):
    """A warm cache starts no trial the first run rejected, even where the steps are far from those
    remembered (a busy machine): trying again would cost what the first trial cost, for nothing."""
    rewrite_entry(tmp_path, lambda entry: entry["trials"]["channels_last"].update(ms_per_step_without=1e-4))
    second, _ = run(tmp_path, "second", "--trial", "channels_last")
    assert second["trials"] == []
    assert unit(second, "channels_last")["reason_code"] == "remembered"


@pytest.mark.slow
def test_a_kept_decision_clearly_contradicted_by_this_runs_steps_is_tried_again(tmp_path, after_first_run):
    rewrite_entry(
        tmp_path, lambda entry: entry["trials"]["channels_last"].update(decision="kept", ms_per_step_with=1e-4)
    )
    second, _ = run(tmp_path, "second", "--trial", "channels_last")
    check, trial = second["trials"]
    assert check["decision"] == "differs" and check["ratio"] > 100
    assert "check" not in trial and trial["decision"] == "rejected"
    assert unit(second, "channels_last")["reason_code"] == "rejected"
    (path,) = entry_paths(tmp_path)
    assert json.loads(path.read_text())["trials"]["channels_last"]["run"] == 2  # decided again, in run 2


@pytest.mark.slow
def test_an_entry_of_another_autogaudi_version_is_ignored_with_a_note(tmp_path, after_first_run):
    rewrite_entry(tmp_path, lambda entry: entry["setup"].update(autogaudi="0.0.1"))
    second, _ = run(tmp_path, "second", "--trial", "channels_last")
    assert unit(second, "step_profiler")["reason_code"] != "remembered_profile"
    assert "entry_other_setup" in second["cache"]["note_codes"]


@pytest.mark.slow
def test_options_that_steer_decisions_are_part_of_the_key_and_the_others_are_not(tmp_path, after_first_run):
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
    _, plain_ranks = torchrun(tmp_path, *PLAIN_TORCHRUN, script, env={"STEPS": "30", "SLOW_HOST_RANK": "0"})
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


@pytest.mark.slow
def test_precision_auto_remembers_its_speed_trial_and_still_guards_every_run(tmp_path):
    focus = ("--precision", "auto", "--disable", "channels_last,graph_capture")
    first, _ = run(tmp_path, "first", *focus, steps=90)
    (trial,) = [record for record in first["trials"] if record["candidate"] == "mixed_precision"]
    assert trial["decision"] == "rejected"
    second, _ = run(tmp_path, "second", *focus, steps=90)
    assert second["trials"] == []  # the rejection holds, unchecked
    assert unit(second, "mixed_precision")["reason_params"]["run"] == 1
    assert "guard_s" not in unit(second, "mixed_precision")["figures"]  # rejected: nothing was set up
    rewrite_entry(tmp_path, lambda entry: entry["trials"]["mixed_precision"].update(decision="kept"))
    third, _ = run(tmp_path, "third", *focus, steps=90)
    assert third["trials"][0]["decision"] == "matches"
    assert "guard_s" in unit(third, "mixed_precision")["figures"]  # kept: numerics checked again first


@pytest.mark.slow
def test_a_remembered_kept_capture_is_set_up_at_once_and_compiles_from_the_cache(tmp_path):
    focus = ("--trial", "graph_capture", "--disable", "channels_last")
    first, _ = run(tmp_path, "first", *focus)
    assert [record["candidate"] for record in first["trials"]] == ["graph_capture"]
    assert unit(first, "graph_capture")["figures"]["compile_cache"] == "miss"
    inductor = tmp_path / "cache" / "compile" / "inductor"  # torch.compile's cache, kept in autogaudi's
    assert first["cache"]["compile"]["TORCHINDUCTOR_CACHE_DIR"] == {"value": str(inductor), "set_by": "autogaudi"}
    assert any(inductor.iterdir())
    rewrite_entry(tmp_path, lambda entry: entry["trials"]["graph_capture"].update(decision="kept"))
    second, second_output = run(tmp_path, "second", *focus)
    row = unit(second, "graph_capture")
    (check,) = second["trials"]  # kept without a trial of its own
    assert check["check"] == "remembered" and check["arm"] == "with" and check["decision"] == "matches"
    assert row["figures"]["compile_cache"] == "hit"  # the first run's trial compiled it into the cache
    assert row["reason_code"] == "remembered" and row["status"] == "applied"
    assert "run 1's trial" in row["changes"][0] and "compiled from the cache" in row["changes"][0]
    assert second_output.startswith("loss ")


MODEL = nn.Linear(2, 2)
INPUTS = [[4, 2]]


def memory(tmp_path, **options):
    return Memory(Cache(str(tmp_path / "cache"), 1 << 30), CpuBackend("test"), Options(**options))


def valid_entry(remembering) -> dict:
    figures = {"ms_per_step": 1.0, "input_wait_fraction": 0.0, "ops_per_step": 9, "compute_fraction": 0.5}
    stamp = {"run": 1, "date": "2025-01-01 10:00:00"}
    return {
        "format": 1,
        "setup": remembering.setup,
        "script": "/work/train.py",
        "argv": [],
        "model": "Linear",
        "backend": "cpu",
        "device": "x86_64 CPU",
        "profile": {
            "bound": "host",
            "why": "w",
            "figures": {**figures, "compute_fraction_range": [0.4, 0.6]},
            "calls_per_step": 1,
            **stamp,
        },
        "trials": {
            "channels_last": {
                "decision": "rejected",
                "speedup": 0.9,
                "ms_per_step_with": 1.1,
                "ms_per_step_without": 1.0,
                **stamp,
            }
        },
        "runs": 1,
        "last_run_on": stamp["date"],
    }


def planted(tmp_path, change=None):
    """An entry for MODEL and INPUTS, as a run wrote it (changed by ``change``); its path."""
    remembering = memory(tmp_path)
    entry = valid_entry(remembering)
    if change is not None:
        change(entry)
    path = remembering._entry_path(MODEL, INPUTS)
    remembering.cache.write_json(path, entry)
    return path


def test_a_valid_entry_is_recalled(tmp_path):
    planted(tmp_path)
    assert memory(tmp_path).recall(MODEL, INPUTS)["runs"] == 1


WRONG = {
    "profile_not_an_object": lambda entry: entry.update(profile="zzz"),
    "unknown_bound": lambda entry: entry["profile"].update(bound="zzz"),
    "figures_missing": lambda entry: entry["profile"].pop("figures"),
    "trial_not_an_object": lambda entry: entry["trials"].update(channels_last="kept"),
    "unknown_decision": lambda entry: entry["trials"]["channels_last"].update(decision="zzz"),
    "runs_a_string": lambda entry: entry.update(runs="2"),
    "runs_a_boolean": lambda entry: entry.update(runs=True),
    "trials_a_list": lambda entry: entry.update(trials=[]),
}


@pytest.mark.parametrize("wrong", WRONG)
def test_an_entry_with_a_wrong_field_is_dropped_with_a_note(tmp_path, wrong):
    planted(tmp_path, WRONG[wrong])
    remembering = memory(tmp_path)
    assert remembering.recall(MODEL, INPUTS) is None
    assert [note.code for note in remembering.notes] == ["entry_invalid"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_a_spoilt_entry_is_dropped_with_a_note(tmp_path, how):
    path = planted(tmp_path)
    wrong = json.dumps({**valid_entry(memory(tmp_path)), "profile": "zzz"}).encode()
    corrupt(pathlib.Path(path), how, tmp_path / "outside", wrong=wrong)
    remembering = memory(tmp_path)
    assert remembering.recall(MODEL, INPUTS) is None
    expected = "entry_invalid" if how == "wrong_schema" else "entry_unreadable"
    assert [note.code for note in remembering.notes] == [expected]


REPORT_ONLY = {
    "verbose": True,
    "quiet": True,
    "report": "run.json",
    "log_every": 5,
    "cache_dir": "/elsewhere",
    "cache_max_mb": 1,
    "no_cache": True,
    "cache_trust_shared": True,
}


@pytest.mark.parametrize("option", REPORT_ONLY)
def test_options_that_only_shape_the_report_or_the_cache_leave_the_key_alone(tmp_path, option):
    assert memory(tmp_path, **{option: REPORT_ONLY[option]}).folder == memory(tmp_path).folder
    assert memory(tmp_path, warmup_steps=4).folder != memory(tmp_path).folder  # one that steers decisions
