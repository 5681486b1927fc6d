"""autogaudi under the frameworks users already train with: the Hugging Face Trainer, accelerate
(``accelerate launch`` with 2 processes around a plain Accelerator loop) and PyTorch Lightning's
Trainer.fit. Each script runs plain and under autogaudi in fresh interpreters: the losses must match
within tolerance, and the report must say what autogaudi did and where it stepped aside because the
framework already does the same thing."""

import json

import pytest
import torch

from tests.helpers import TESTS, clean_env, run_python, run_ranks, said

HERE = TESTS / "frameworks"
# Trainer/Lightning/accelerate steps under autogaudi differ from plain ones by float reassociation
# only (fused kernels); over 20-64 steps that stays far below this.
LOSS_RTOL = 1e-3


def last_json_line(result) -> dict:
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def units_of(path) -> dict:
    return {row["name"]: row for row in json.loads(path.read_text())["units"]}


@pytest.mark.slow
def test_hugging_face_trainer_trains_alike_and_its_own_choices_are_kept(tmp_path):
    script = HERE / "hf_trainer_train.py"
    plain = last_json_line(run_python(script, tmp_path / "plain", timeout=600))
    report = tmp_path / "report.json"
    tuned = last_json_line(run_python("-m", "autogaudi", "--report", report, script, tmp_path / "tuned", timeout=600))
    assert len(tuned["losses"]) == len(plain["losses"]) == 20
    torch.testing.assert_close(tuned["losses"], plain["losses"], rtol=LOSS_RTOL, atol=1e-5)
    units = units_of(report)
    # Trainer already builds a fused AdamW (optim="adamw_torch_fused"): autogaudi steps aside.
    assert said(units["fused_optimizer"]) == [
        ("optimizer_kept", {"optimizer": "AdamW", "why": "the script chose fused=True", "refusal": None})
    ]
    assert units["fused_optimizer"]["figures"] == {"optimizers_fused": 0, "optimizers_kept": 1}
    assert "script_chose_workers" in units["loader_workers"]["note_codes"]
    assert units["step_profiler"]["figures"]["model"] == "BertForSequenceClassification"
    # 20 steps: no compile trial could pay for itself, and Trainer says how many steps are left.
    capture = units["graph_capture"]
    assert capture["reason_code"] == "too_short"
    # the steps left once the profile was published (three to five census pairs: the machine decides),
    # counted by the Trainer, whose step count lags the one under way
    left = 20 - units["step_profiler"]["figures"]["profiled_at_step"] + 1
    assert (capture["reason_params"]["steps"], capture["reason_params"]["source"]) == (
        left,
        "Hugging Face Trainer max_steps",
    )


@pytest.mark.slow
def test_accelerate_launch_with_two_processes_trains_alike(tmp_path):
    script = HERE / "accelerate_loop.py"
    # accelerate's torchrun-based launcher is behind --multi_gpu (--cpu would start one process);
    # the script's Accelerator(cpu=True) then trains on gloo.
    launch = (
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        "0",
    )
    runs = {}
    for name, env in (("plain", {}), ("autogaudi", {"AUTOGAUDI": "1", "AUTOGAUDI_QUIET": "1"})):
        results = tmp_path / name
        results.mkdir()
        result = run_ranks(*launch, script, env=clean_env(RESULTS=results, **env), timeout=600)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = [json.loads((results / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for plain, tuned in zip(runs["plain"], runs["autogaudi"]):
        torch.testing.assert_close(tuned["losses"], plain["losses"], rtol=LOSS_RTOL, atol=1e-5)
        torch.testing.assert_close(tuned["checksum"], plain["checksum"], rtol=LOSS_RTOL, atol=1e-5)
    assert runs["autogaudi"][0]["checksum"] == runs["autogaudi"][1]["checksum"]  # DDP kept ranks in step
    for worker in runs["autogaudi"]:
        assert worker["units"]["ddp_tuning"]["figures"]["ddp_models_tuned"] == 1
        assert worker["units"]["fused_optimizer"]["status"] == "applied"


@pytest.mark.slow
def test_lightning_trainer_fit_trains_alike(tmp_path):
    script = HERE / "lightning_fit.py"
    plain = last_json_line(run_python(script, timeout=600))
    report = tmp_path / "report.json"
    # forced: what is tested is that Lightning's step(closure) runs fused, not whether timing keeps it
    forced = ("--force", "fused_optimizer")
    tuned = last_json_line(run_python("-m", "autogaudi", *forced, "--report", report, script, timeout=600))
    assert len(tuned["losses"]) == len(plain["losses"]) == 64
    torch.testing.assert_close(tuned["losses"], plain["losses"], rtol=LOSS_RTOL, atol=1e-5)
    units = units_of(report)
    assert units["fused_optimizer"]["figures"]["optimizers_fused"] == 1  # Lightning's step(closure) too
    assert units["step_profiler"]["figures"]["model"] == "Sequential"  # the module training_step calls
    assert units["graph_capture"]["reason_params"]["source"] == "Lightning Trainer estimated_stepping_batches"
