"""ddp_tuning: in-process DDP (gloo, world size 1) for the settings and the numerics; torchrun with
2 ranks for the three launch forms, agreement with plain DDP, and failures reported as torchrun does."""

import json
import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import autogaudi
from autogaudi.core.registry import UNIT_NAMES
from autogaudi.optimizations.ddp_tuning import hpu_bucket_megabytes
from tests.helpers import SCRIPTS, said
from tests.optimizations.ddp_helpers import PLAIN_TORCHRUN, TORCHRUN, mlp, torchrun, train


def syncs_buffers_every_forward(model) -> bool:
    return (
        getattr(model, "forward_sync_buffers", None)
        if hasattr(model, "forward_sync_buffers")
        else model.broadcast_buffers
    )


def test_defaults_tuned_and_numerics_unchanged(process_group):
    plain = train(DistributedDataParallel(mlp()))
    autogaudi.enable(device="cpu", only="ddp_tuning")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation warning the plain run would not print
        model = DistributedDataParallel(mlp())
    assert model.gradient_as_bucket_view is True and syncs_buffers_every_forward(model) is False
    torch.testing.assert_close(train(model), plain, rtol=0, atol=0)
    settings = autogaudi.report().unit("ddp_tuning")["figures"]["last_settings"]
    assert settings["gradient_as_bucket_view"] is True
    assert settings.get("forward_sync_buffers", settings.get("broadcast_buffers")) is False


def test_explicit_arguments_buffers_and_subclasses_are_kept(process_group):
    autogaudi.enable(device="cpu", only="ddp_tuning")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the script's own deprecated argument
        explicit = DistributedDataParallel(mlp(), None, None, 0, True, gradient_as_bucket_view=False, bucket_cap_mb=5)
    assert explicit.gradient_as_bucket_view is False and syncs_buffers_every_forward(explicit) is True
    with_norm = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8)))
    assert syncs_buffers_every_forward(with_norm) is True  # running statistics must stay in sync

    class MyDDP(DistributedDataParallel):
        pass

    assert MyDDP(mlp()).gradient_as_bucket_view is False
    assert ("kept_own_settings", {"settings": "broadcast_buffers, bucket_cap_mb, gradient_as_bucket_view"}) in said(
        autogaudi.report().unit("ddp_tuning")
    )


def test_hpu_bucket_size_follows_the_gaudi_guide():
    def params(megabytes):
        return torch.nn.Linear(1, int(megabytes * 1024**2 / 4), bias=False)

    assert hpu_bucket_megabytes(params(98)) == 98  # ResNet50-sized gradients: about 100 MB
    assert hpu_bucket_megabytes(params(400)) == 230  # optimum-habana's cap
    assert hpu_bucket_megabytes(params(20)) == 10  # small models: at least two buckets


@pytest.mark.slow
def test_every_launch_form_enables_each_worker_once_and_trains_like_plain_ddp(tmp_path):
    script = str(SCRIPTS / "ddp_train.py")
    result, plain = torchrun(tmp_path, *PLAIN_TORCHRUN, script)
    assert result.returncode == 0, result.stderr[-3000:]
    assert plain[0]["checksum"] == plain[1]["checksum"] and not plain[0]["autogaudi"]
    forms = {
        "launcher around torchrun": torchrun(
            tmp_path, "-m", "autogaudi", "--report", tmp_path / "report.json", *TORCHRUN, script
        ),
        "torchrun around the launcher": torchrun(tmp_path, *PLAIN_TORCHRUN, "-m", "autogaudi", script),
        "AUTOGAUDI=1": torchrun(tmp_path, *TORCHRUN, script, env={"AUTOGAUDI": "1"}),
    }
    for form, (result, workers) in forms.items():
        assert result.returncode == 0, (form, result.stderr[-3000:])
        assert [w["rank"] for w in workers] == [0, 1], form
        for worker in workers:
            assert worker["autogaudi"] and worker["bucket_view"], form
            torch.testing.assert_close(worker["checksum"], plain[0]["checksum"], rtol=1e-5, atol=1e-6)
        assert result.stderr.count("autogaudi 0.1.0 report") == 1, form  # rank 0 only, agent silent
        assert "ranks    2 of 2 reported their unit decisions; all the same" in result.stderr, form
    ranks = json.loads((tmp_path / "report.json").read_text())["ranks"]  # rank 0's JSON has every rank's rows
    assert sorted(ranks) == ["0", "1"]
    assert [row["name"] for row in ranks["1"]] == [row["name"] for row in ranks["0"]] == list(UNIT_NAMES)
    assert {row["name"]: row["status"] for row in ranks["1"]}["ddp_tuning"] == "applied"


@pytest.mark.slow
def test_a_failing_worker_is_reported_by_torchrun_as_without_autogaudi(tmp_path):
    script = str(SCRIPTS / "ddp_train.py")
    plain, _ = torchrun(tmp_path, *PLAIN_TORCHRUN, script, env={"FAIL_RANK": "1"})
    launched, _ = torchrun(tmp_path, "-m", "autogaudi", "--quiet", *TORCHRUN, script, env={"FAIL_RANK": "1"})
    assert plain.returncode == launched.returncode != 0
    for result in (plain, launched):
        assert "RuntimeError: rank 1 failed on purpose" in result.stderr
        assert "ChildFailedError" in result.stderr


def test_static_graph_is_suggested_not_set_where_ddp_searches_for_unused_parameters(process_group):
    autogaudi.enable(device="cpu", only="ddp_tuning")
    searching = DistributedDataParallel(mlp(), find_unused_parameters=True)
    assert searching.static_graph is False and searching.find_unused_parameters is True
    notes = autogaudi.report().unit("ddp_tuning")["note_codes"]
    assert "static_graph_advice" in notes, notes
    DistributedDataParallel(mlp(), find_unused_parameters=True, static_graph=True)
    assert autogaudi.report().unit("ddp_tuning")["note_codes"].count("static_graph_advice") == 1
