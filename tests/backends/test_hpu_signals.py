"""Gaudi's run-time signals (autogaudi.backends.hpu_signals), against the HPU double: CPU fallbacks
and graph compilations injected into its metrics reach the short report and the JSON, by code."""

import json
import sys
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader, TensorDataset

import autogaudi
from autogaudi.backends import hpu_signals

WARMUP = 3  # the default warmup_steps


def train(steps, inject=None, samples=None, batch_size=8):
    """A DataLoader loop of ``steps`` steps; ``inject(step, metrics)`` runs inside each step."""
    metrics = sys.modules["habana_frameworks.torch.hpu.metrics"]
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(samples or steps * batch_size, 4), torch.randn(samples or steps * batch_size, 2))
    for step, (inputs, targets) in enumerate(DataLoader(data, batch_size=batch_size)):
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        if inject is not None:
            inject(step, metrics)
        optimizer.step()
        optimizer.zero_grad()


def run(hpu_double, disable=(), **loop):
    calls = hpu_double(lazy=True)
    autogaudi.enable(device="hpu", disable=disable)
    train(**loop)
    report = autogaudi.report()
    signals = json.loads(report.to_json())["backend"]["signals"]
    return calls, report, signals


def codes(signals) -> list:
    return [finding["code"] for finding in signals["findings"]]


def test_cpu_fallbacks_after_warm_up_reach_both_reports(hpu_double):
    def inject(step, metrics):
        metrics.inject_cpu_fallback("aten::nonzero", count=2)

    calls, report, signals = run(hpu_double, steps=6, inject=inject)
    assert codes(signals) == ["cpu_fallback"]
    assert signals["warmup"]["cpu_fallbacks"] == 2 * WARMUP
    op = signals["cpu_fallback_ops"]["aten::nonzero"]
    assert (op["count"], op["steps"], op["first_step"]) == (6, 3, WARMUP + 1)
    assert "[cpu_fallback]" in report.format() and "aten::nonzero" in report.format()
    assert [name for name in calls.names() if name.startswith("inject")] == ["inject_cpu_fallback"] * 6


def test_the_bridge_metrics_are_read_once_at_each_step_end(hpu_double):
    calls, _, signals = run(hpu_double, steps=5)
    reads = sys.modules["habana_frameworks.torch.hpu.metrics"].READS
    one_read = [("metric_global", "cpu_fallback"), ("stats", "cpu_fallback")]
    one_read += [("metric_global", "graph_compilation"), ("stats", "graph_compilation")]
    assert reads == one_read * (1 + 5)  # at the start, and after each of the 5 steps
    assert signals["steps_read"] == 5 and signals["findings"] == []


def test_a_clean_run_says_nothing_of_gaudi_signals(hpu_double):
    _, report, signals = run(hpu_double, steps=5)
    assert signals["compilations_after_warmup"] == 0 and signals["cpu_fallback_ops"] == {}
    assert "gaudi:" not in report.format()


def test_a_compilation_on_the_short_last_batch_names_static_last_batch(hpu_double):
    def inject(step, metrics):
        if step in (0, 5):  # the first step compiles; the short last batch (step 5) compiles again
            metrics.inject_compilation()

    # static_last_batch would pad the short batch: off, as where a script's sampler cannot be padded
    calls, report, signals = run(hpu_double, disable=("static_last_batch",), steps=6, inject=inject, samples=44)
    assert codes(signals) == ["recompiled_short_batch"]
    assert signals["warmup"]["compilations"] == 1
    assert signals["compiled_steps"] == [{"step": 6, "compilations": 1, "micros": 1000, "shapes": [[4, 4], [4, 2]]}]
    assert signals["warmup_shapes"] == [[8, 4], [8, 2]]
    assert "[recompiled_short_batch]" in report.format()
    assert calls.names().count("inject_compilation") == 2


def test_compilations_on_new_shapes_and_on_the_same_shapes_are_told_apart(hpu_double):
    hpu_double(lazy=True)
    autogaudi.enable(device="hpu")
    train(steps=5, inject=lambda step, metrics: step == 4 and metrics.inject_compilation())
    # A second loader with longer rows after warm-up: new shapes.
    metrics = sys.modules["habana_frameworks.torch.hpu.metrics"]
    model = torch.nn.Linear(6, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for inputs, _targets in DataLoader(TensorDataset(torch.randn(8, 6), torch.randn(8, 2)), batch_size=8):
        model(inputs).sum().backward()
        metrics.inject_compilation()
        optimizer.step()
    signals = json.loads(autogaudi.report().to_json())["backend"]["signals"]
    assert codes(signals) == ["recompiled_same_shapes", "recompiled_new_shapes"]
    assert [record["step"] for record in signals["compiled_steps"]] == [5, 6]


def test_a_metric_read_that_fails_silences_the_signals_not_the_run(hpu_double, monkeypatch):
    hpu_double(lazy=True)
    autogaudi.enable(device="hpu")
    metrics = sys.modules["habana_frameworks.torch.hpu.metrics"]
    monkeypatch.setattr(metrics, "metric_global", lambda name: 1 / 0)
    train(steps=5)
    signals = json.loads(autogaudi.report().to_json())["backend"]["signals"]
    assert "ZeroDivisionError" in signals["failure"] and signals["steps_read"] == 0


def test_other_backends_have_no_signals():
    autogaudi.enable(device="cpu")
    try:
        train_cpu = json.loads(autogaudi.report().to_json())["backend"]
        assert "signals" not in train_cpu
    finally:
        autogaudi.disable()


def test_compilations_while_a_trial_runs_are_autogaudis_not_the_scripts(hpu_double):
    def inject(step, metrics):
        trials = autogaudi.entry.runtime._STATE.session.trials
        trials.current = SimpleNamespace(unit=None) if step == 4 else None  # a trial over step 5 only
        if step == 4:
            metrics.inject_compilation()  # what a graph capture on trial compiles

    _, report, signals = run(hpu_double, steps=6, inject=inject)
    assert (signals["compilations_by_autogaudi"], signals["compilations_after_warmup"]) == (1, 0)
    assert signals["findings"] == [] and "gaudi:" not in report.format()


def test_compilations_of_autogaudis_own_capture_outside_a_trial_are_not_the_scripts(hpu_double):
    """A forced capture compiles in the step its captured call first runs: no trial is running, and
    the step's compilations (its backward's too) are still autogaudi's; the next step's are the script's."""

    def inject(step, metrics):
        if step == 4:
            autogaudi.entry.runtime._STATE.session.backend.compiling_for_autogaudi()
            metrics.inject_compilation()
        if step == 5:
            metrics.inject_compilation()

    _, _report, signals = run(hpu_double, steps=7, inject=inject)
    assert (signals["compilations_by_autogaudi"], signals["compilations_after_warmup"]) == (1, 1)
    assert [record["step"] for record in signals["compiled_steps"]] == [6]


def test_a_fallback_names_the_scripts_line_that_calls_the_op(hpu_double, tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("import torch\n# torch.nonzero(x) in a comment\nkept = torch.nonzero(mask)\n")
    monkeypatch.setattr(hpu_signals, "script_path", lambda: str(script))
    _, report, signals = run(
        hpu_double, steps=5, inject=lambda step, metrics: metrics.inject_cpu_fallback("aten::nonzero")
    )
    assert signals["cpu_fallback_ops"]["aten::nonzero"]["where"] == "train.py:3"
    assert signals["findings"][0]["params"]["line"] == "train.py:3"


def test_the_fallback_hint_names_the_logging_variables_of_the_current_docs():
    """docs.habana.ai (Placement of Ops on HPU): fallback logs with PT_HPU_LOG_MOD_MASK=0x80
    PT_HPU_LOG_TYPE_MASK=0x8; the older LOG_LEVEL_PT_FALLBACK is gone from the current pages."""
    from autogaudi.backends.hpu_signals import REASONS

    assert "PT_HPU_LOG_MOD_MASK=0x80 PT_HPU_LOG_TYPE_MASK=0x8" in REASONS["cpu_fallback"]
    assert "LOG_LEVEL_PT_FALLBACK" not in REASONS["cpu_fallback"]
