"""activation_checkpointing's rescue of a training forward that runs out of memory: the run goes on
with every block checkpointed and its losses and buffers are plain's (without the failure) bitwise;
an out-of-memory error outside the forward ends the run as plain's, and the next run (with a cache)
checkpoints the blocks from its first step. The matcher knows CUDA's and Gaudi's messages."""

import json

import pytest
import torch

import autogaudi
from autogaudi.watch.out_of_memory import is_out_of_memory
from tests.gpt_model import OutOfMemoryGPT, train
from tests.helpers import clean_env, run_python

ONLY = "step_profiler,activation_checkpointing"
ROOMY = 1.0  # GiB, --memory-limit: a budget the forecast fits in, so only the rescue checkpoints
SCRIPT = "tests/scripts/oom_train.py"


def unit_row():
    return autogaudi.report().unit("activation_checkpointing")


@pytest.mark.parametrize(
    "error",
    [
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("FATAL ERROR :: MODULE:DEVMEM/SYNHELPER Allocation failed for size::1073741824 (1024)MB"),
        RuntimeError("FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::1073741824 (1024)MB"),
    ],
    ids=["cuda", "gaudi_synhelper", "gaudi_pt_devmem"],
)
def test_a_forward_that_runs_out_of_memory_is_run_again_checkpointed_as_plain(error):
    plain, plain_model = train(make=lambda: OutOfMemoryGPT())
    autogaudi.enable(device="cpu", only=ONLY, memory_limit=ROOMY)
    losses, model = train(make=lambda: OutOfMemoryGPT(at=3, error=error))
    row = unit_row()
    assert losses == plain  # bitwise: random state put back, checkpointing recomputes the same masks
    assert torch.equal(model.calls_seen, plain_model.calls_seen)  # the failed call's buffer update undone
    assert row["status"] == "applied" and row["reason_code"] == "rescued"
    assert row["reason_params"]["buffers"] == 1 and row["reason_params"]["step"] == 2
    assert row["figures"]["blocks_checkpointed"] == [f"blocks.{index}" for index in range(len(model.blocks))]
    assert row["figures"]["next_run"]["code"] == "next_run_no_cache"
    autogaudi.disable()
    assert all("_compiled_call_impl" not in vars(sub) for sub in model.modules())


def test_an_error_that_is_not_out_of_memory_propagates_and_changes_nothing():
    autogaudi.enable(device="cpu", only=ONLY, memory_limit=ROOMY)
    with pytest.raises(ValueError, match="the script's"):
        train(make=lambda: OutOfMemoryGPT(at=3, error=ValueError("the script's")))
    row = unit_row()
    assert row["reason_code"] == "fits" and "blocks_checkpointed" not in row["figures"]


def test_without_a_budget_no_layer_sits_on_the_training_models_calls():
    """No device whose memory could run out (the CPU, no --memory-limit): every call plain's."""
    from autogaudi.watch import model_call

    autogaudi.enable(device="cpu", only=ONLY)
    _, model = train(steps=3, make=lambda: OutOfMemoryGPT())
    assert model_call.route_of(model) is None and unit_row()["reason_code"] == "no_budget"


def test_the_matcher_tells_out_of_memory_from_other_errors():
    assert is_out_of_memory(torch.OutOfMemoryError("anything"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert not is_out_of_memory(RuntimeError("FATAL ERROR :: MODULE:BRIDGE graph compile failed"))
    assert not is_out_of_memory(ValueError("CUDA out of memory."))


def _run(tmp_path, *launcher, **env):
    report = tmp_path / "report.json"
    args = [*launcher, "--only", ONLY, "--report", report] if launcher else []
    result = run_python(*args, SCRIPT, env=clean_env(**env))
    return result, (json.loads(report.read_text()) if launcher and report.exists() else None)


@pytest.mark.slow
def test_out_of_memory_in_the_backward_ends_as_plain_and_the_next_run_checkpoints_from_its_first_step(tmp_path):
    cache = dict(AUTOGAUDI_NO_CACHE="0", AUTOGAUDI_CACHE_DIR=tmp_path / "cache", AUTOGAUDI_MEMORY_LIMIT=str(ROOMY))
    plain, _ = _run(tmp_path, OOM_AT="3", OOM_WHERE="backward")
    ours, report = _run(tmp_path, "-m", "autogaudi", OOM_AT="3", OOM_WHERE="backward", **cache)
    assert plain.returncode == ours.returncode == 1
    error_line = plain.stderr.strip().splitlines()[-1]
    assert error_line.startswith("torch.OutOfMemoryError")
    assert error_line in ours.stderr
    row = next(row for row in report["units"] if row["name"] == "activation_checkpointing")
    assert row["figures"]["next_run"]["code"] == "next_run"
    assert "not_rescued" in row["note_codes"]
    assert ours.stderr.strip().splitlines()[-1].startswith("  next run activation_checkpointing")

    clean, _ = _run(tmp_path)
    again, report = _run(tmp_path, "-m", "autogaudi", **cache)
    assert again.returncode == 0, again.stderr
    row = next(row for row in report["units"] if row["name"] == "activation_checkpointing")
    assert row["reason_code"] == "out_of_memory_remembered" and row["figures"]["checkpointed_from_step"] == 0
    assert len(row["figures"]["blocks_checkpointed"]) == 4
    assert again.stdout == clean.stdout  # the losses, bitwise
