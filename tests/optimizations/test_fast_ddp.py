"""fast_ddp: 2 gloo ranks under torchrun for what only several ranks show (averaging, no_sync,
unused parameters, the hand-back to DDP when the parameter set changes); in-process DDP with one rank
for the cases where DDP keeps its own gradient sync."""

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import autogaudi
from tests.helpers import SCRIPTS, said
from tests.optimizations.ddp_helpers import PLAIN_TORCHRUN, TORCHRUN, mlp, torchrun, train

ONLY_DDP_UNITS = {"AUTOGAUDI_ONLY": "ddp_tuning,fast_ddp", "AUTOGAUDI_FORCE": "fast_ddp", "AUTOGAUDI_QUIET": "1"}


def keep_local_gradients(_state, bucket):
    """A communication hook (the script's own gradient sync): here, none at all."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


@pytest.mark.slow
def test_ranks_end_equal_to_each_other_and_to_plain_ddp(tmp_path):
    """One job for what each of its knobs alone would show: no_sync micro-steps are not averaged (ten
    flat all-reduces in ten steps of three micro-steps), clipping sees averages (each step's last
    micro-step is a plain loop's step: no case of its own), and a layer only rank 1 uses is averaged
    onto rank 0 too, as with DDP (else rank 0's copy of it never moves)."""
    knobs = {"ACCUMULATE": "3", "CLIP": "1", "BRANCH": "rank1"}
    script = str(SCRIPTS / "ddp_train.py")
    result, plain = torchrun(tmp_path, *PLAIN_TORCHRUN, script, env=knobs)
    assert result.returncode == 0, result.stderr[-3000:]
    result, fast = torchrun(tmp_path, *TORCHRUN, script, env={**knobs, "AUTOGAUDI": "1", **ONLY_DDP_UNITS})
    assert result.returncode == 0, result.stderr[-3000:]
    for worker in fast:
        assert worker["checksum"] == fast[0]["checksum"]  # bit-identical across ranks
        torch.testing.assert_close(worker["checksum"], plain[0]["checksum"], rtol=1e-5, atol=1e-5)
        row = worker["units"]["fast_ddp"]
        assert row["status"] == "applied" and counted(row) == {"models": 1, "flat_all_reduces": 10}, row
        # two ranks: a sum of two values is the same in any order, and x / 2 == x * 0.5
        assert set(row["numerics_measured"]) == MEASURED_KEYS and row["numerics_measured"]["max_rel_diff"] == 0.0


MEASURED_KEYS = {"max_rel_diff", "of", "steps", "against"}


def counted(row) -> dict:
    return {key: row["figures"][key] for key in ("models", "flat_all_reduces")}


NOT_MEASURING = """import runpy, sys
import autogaudi.measure.numerics
autogaudi.measure.numerics.FREE_SHARE = 0.0  # no copy fits: the rounding is not measured
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_three_ranks_measure_against_ddps_buckets_and_measuring_changes_nothing(tmp_path):
    """With three ranks the figure is whatever the sums' order gives; the parameters are bitwise
    those of a run that did not measure (the copies are all-reduced apart from the flat buffer)."""
    script, wrapper = str(SCRIPTS / "ddp_train.py"), tmp_path / "not_measuring.py"
    wrapper.write_text(NOT_MEASURING)
    three = (*TORCHRUN[:-1], "3")
    env = {"AUTOGAUDI": "1", **ONLY_DDP_UNITS}
    result, measured = torchrun(tmp_path, *three, script, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    result, unmeasured = torchrun(tmp_path, *three, str(wrapper), script, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(measured) == len(unmeasured) == 3
    for one, other in zip(measured, unmeasured):
        assert one["digest"] == other["digest"] == measured[0]["digest"]
        figure = one["units"]["fast_ddp"]["numerics_measured"]
        assert set(figure) == MEASURED_KEYS and figure["steps"] == 1
        assert figure == measured[0]["units"]["fast_ddp"]["numerics_measured"]  # the same result on every rank
        row = other["units"]["fast_ddp"]
        assert row["numerics_measured"] is None and [code for code, _ in said(row)] == ["rounding_not_measured_memory"]


@pytest.mark.slow
def test_a_changing_parameter_set_hands_every_rank_back_to_ddp_at_the_same_step(tmp_path):
    script, knobs = str(SCRIPTS / "ddp_train.py"), {"BRANCH": "from_step5"}
    _, plain = torchrun(tmp_path, *PLAIN_TORCHRUN, script, env=knobs)
    result, fast = torchrun(tmp_path, *TORCHRUN, script, env={**knobs, "AUTOGAUDI": "1", **ONLY_DDP_UNITS})
    assert result.returncode == 0, result.stderr[-3000:]
    for worker in fast:
        torch.testing.assert_close(worker["checksum"], plain[0]["checksum"], rtol=1e-5, atol=1e-5)
        row = worker["units"]["fast_ddp"]
        # the branch is used from step 5; the counts are read one step late, so step 6 is the last
        assert row["figures"]["flat_all_reduces"] == 7, row
        assert row["reason_code"] == "gradients_changed", row
        assert (row["reason_params"]["first"], row["reason_params"]["then"]) == (
            "[2, 2, 2, 2, 0, 0]",
            "[2, 2, 2, 2, 2, 2]",
        )


def test_ddp_keeps_models_whose_gradient_sync_the_script_customised(process_group):
    plain = train(DistributedDataParallel(mlp(), static_graph=True))
    autogaudi.enable(device="cpu", only="fast_ddp", force="fast_ddp")
    static = DistributedDataParallel(mlp(), static_graph=True)
    torch.testing.assert_close(train(static), plain, rtol=0, atol=0)
    hooked = DistributedDataParallel(mlp())
    hooked.register_comm_hook(None, keep_local_gradients)
    row = autogaudi.report().unit("fast_ddp")
    assert row["figures"]["flat_all_reduces"] == 0
    assert said(row) == [("ddp_keeps_sync", {"why": "the script set static_graph"})]
    train(hooked, steps=1)
    assert ("ddp_keeps_sync", {"why": "the script set a communication hook"}) in said(
        autogaudi.report().unit("fast_ddp")
    )


def test_one_rank_trains_exactly_like_ddp_and_disable_restores_forward(process_group):
    original = DistributedDataParallel.forward
    plain = train(DistributedDataParallel(mlp()))
    autogaudi.enable(device="cpu", only="fast_ddp", force="fast_ddp")
    assert DistributedDataParallel.forward is not original
    torch.testing.assert_close(train(DistributedDataParallel(mlp())), plain, rtol=0, atol=0)
    row = autogaudi.report().unit("fast_ddp")
    assert counted(row) == {"models": 1, "flat_all_reduces": 10}
    assert set(row["numerics_measured"]) == MEASURED_KEYS and row["numerics_measured"]["max_rel_diff"] == 0.0
    autogaudi.disable()
    assert DistributedDataParallel.forward is original
