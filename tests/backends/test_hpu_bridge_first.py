"""A script that imports the Gaudi bridge before torch, as Intel's examples do, on the HPU double
under both releases: the session starts once the bridge's import is complete, on the HPU backend,
with the units that apply; its numbers are plain's up to FusedAdamW's formula."""

import json

import pytest

from tests.helpers import HPU_DOUBLE, SCRIPTS, clean_env, run_python


def run(*command, release, **env):
    result = run_python(*command, env=clean_env(PYTHONPATH=str(HPU_DOUBLE), HPU_DOUBLE_RELEASE=release, **env))
    assert result.returncode == 0, result.stderr
    return result


def printed(result) -> dict:
    return dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)


@pytest.mark.parametrize("release, entry", [("latest", "launcher"), ("1.19", "launcher"), ("latest", "environment")])
def test_the_session_starts_on_the_hpu_backend_once_the_bridge_imported_first_is_complete(tmp_path, release, entry):
    report_path = tmp_path / "report.json"
    if entry == "launcher":
        result = run("-m", "autogaudi", "--report", report_path, SCRIPTS / "hpu_train.py", release=release)
    else:
        result = run(SCRIPTS / "hpu_train.py", release=release, AUTOGAUDI="1", AUTOGAUDI_REPORT=report_path)
    report = json.loads(report_path.read_text())
    units = {row["name"]: row for row in report["units"]}
    assert report["backend"]["name"] == "hpu" and report["backend"]["lazy"] is (release == "1.19")
    assert report["backend"]["placement"]["on_device"] is True
    assert units["fused_optimizer"]["figures"]["optimizers_fused"] == 1
    assert units["pin_memory"]["status"] == "applied"
    if release == "1.19":
        assert units["step_marks"]["figures"]["mark_steps"] > 0
    else:
        assert units["step_marks"]["reason_code"] == "hpu_eager"
    seen = printed(result)
    assert seen["parameters"] == "on hpu 4 of 4" and seen["batches"] == "on hpu 12 of 12"
    if entry != "launcher":
        return
    plain = printed(run(SCRIPTS / "hpu_train.py", release=release))
    assert plain["parameters"] == "on hpu 4 of 4" and plain["lazy"] == str(release == "1.19")
    # FusedAdamW adds eps to the uncorrected sqrt(v): a formula of its own, within its stated bound here
    assert float(seen["loss"]) == pytest.approx(float(plain["loss"]), rel=1e-4)
