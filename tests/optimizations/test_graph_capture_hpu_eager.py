"""graph_capture in HPU eager mode (the default since lazy mode became the legacy fallback): the
training model compiled with torch.compile's ``hpu_backend``, each repeated block class once; the
double counts each graph the backend is handed as a compilation, through the recipe cache; graph
breaks and recompiles are named from torch's own records."""

import pytest
import torch
from torch import nn

import autogaudi
from autogaudi.measure import one_offs
from tests.optimizations.test_graph_capture import Tower, batches, losses_of, row


def _run_ends():
    """What the session does at exit for graph_capture: torch's compile records are read."""
    from autogaudi.entry import runtime

    for unit in runtime._STATE.session.applied:
        if unit.name == "graph_capture":
            unit.run_ending(None)


def _compiles(calls):
    return [kwargs["kind"] for name, kwargs in calls.CALLS if name == "hpu_backend_compile"]


def test_eager_hpu_compiles_each_block_class_once_with_hpu_backend_and_trains_like_plain(hpu_double, monkeypatch):
    monkeypatch.setattr(one_offs, "REGIONAL_KEEPS", 1.0)  # regional pays back sooner whatever its estimate
    plain = losses_of(Tower(), batches())
    calls = hpu_double(lazy=False)
    from habana_frameworks.torch.hpu import metrics

    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    losses = losses_of(Tower(), batches())
    figures = row()["figures"]
    assert figures["regions"] == {"container": "blocks", "block": "Sequential", "count": 4}
    assert _compiles(calls) == ["forward", "backward"]  # one block graph for the four blocks, and its backward
    assert dict(metrics.metric_global("graph_compilation").stats())["TotalNumber"] == 2
    torch.testing.assert_close(losses, plain, rtol=1e-4, atol=1e-5)
    _run_ends()
    figures = row()["figures"]
    assert figures["graph_breaks"]["count"] == 0 and figures["recompiles"]["count"] == 0


class Chatty(nn.Module):
    """A model whose forward breaks dynamo's graph (a print) and takes a Python number that changes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, inputs, scale=1.0):
        hidden = torch.tanh(self.first(inputs))
        print(end="")
        return self.second(hidden) * scale


def test_graph_breaks_and_recompiles_are_named_with_torchs_codes_and_the_lines(hpu_double, capsys):
    hpu_double(lazy=False)
    torch._dynamo.reset()  # no code compiled for Chatty by an earlier test
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    model, optimizer = Chatty(), None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step, (inputs, labels) in zip(range(14), batches()):
        loss = nn.functional.cross_entropy(model(inputs, scale=1.0 + (step >= 12)), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    _run_ends()
    unit = row()
    breaks, recompiles = unit["figures"]["graph_breaks"], unit["figures"]["recompiles"]
    assert breaks["count"] >= 1 and all(reason["code"].startswith("GB") for reason in breaks["reasons"])
    line = Chatty.forward.__code__.co_firstlineno + 2  # the print
    assert f"test_graph_capture_hpu_eager.py:{line} (forward)" in breaks["where"]
    assert recompiles["count"] >= 1 and any("scale" in reason["reason"] for reason in recompiles["reasons"])
    assert {"graph_breaks", "recompiled"} <= set(unit["note_codes"])


@pytest.mark.parametrize("lazy", [False])
def test_the_second_process_compiles_nothing_through_the_recipe_cache(hpu_double, tmp_path, monkeypatch, lazy):
    monkeypatch.setenv("PT_HPU_RECIPE_CACHE_CONFIG", f"{tmp_path},false,100")
    counted = []
    for _run in range(2):  # each load is a fresh bridge, as a new process's
        calls = hpu_double(lazy=lazy)
        from habana_frameworks.torch.hpu import metrics

        torch._dynamo.reset()
        compiled = torch.compile(Tower(), backend="hpu_backend")
        compiled(torch.randn(4, 16)).sum().backward()
        counted.append((dict(metrics.metric_global("graph_compilation").stats())["TotalNumber"], _compiles(calls)))
        hits = dict(metrics.metric_global("recipe_cache").stats())["TotalHit"]
    assert counted[0] == (2, ["forward", "backward"])
    assert counted[1] == (0, ["forward", "backward"]) and hits == 2


class Scaled(nn.Module):
    """A forward taking a Python number: each value is a graph key of ModuleCacher's of its own."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(16, 3)

    def forward(self, inputs, scale=1.0):
        return self.linear(inputs) * scale


def _train_scaled(model, steps=26):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step, (inputs, labels) in zip(range(steps), batches()):
        loss = nn.functional.cross_entropy(model(inputs, scale=1.0 + step / 10), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_past_module_cachers_graph_limit_the_call_runs_the_plain_forward_and_capture_stays(hpu_double, monkeypatch):
    from autogaudi.optimizations.graph_capture import captured_call

    monkeypatch.setattr(captured_call, "MAX_SHAPES", 100)  # the capture layer's limit lifted: the cacher's comes first
    plain = _train_scaled(Scaled())
    calls = hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    model = Scaled()
    losses = _train_scaled(model)
    names = calls.names()
    assert names.count("module_cacher_capture") == 10 and "module_cacher_uncached" in names
    assert row()["status"] == "applied" and row()["reason_code"] == "captured_forced"
    assert "orig_forward" not in vars(model)
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)


class FallingBack(nn.Module):
    """A forward with an op the bridge runs on the CPU (injected: the double itself never falls back)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(16, 3)

    def forward(self, inputs):
        from habana_frameworks.torch.hpu import metrics

        metrics.inject_cpu_fallback("aten::nonzero")
        return self.linear(inputs)


def test_a_model_with_cpu_fallbacks_is_never_captured_even_forced(hpu_double):
    plain = losses_of(Scaled(), batches())
    calls = hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="step_profiler,graph_capture", force="graph_capture")
    model = FallingBack()
    model.linear = Scaled().linear  # the same start as the plain run's
    losses = losses_of(model, batches())
    assert (row()["reason_code"], row()["reason_params"]) == ("cpu_fallback_ops", {"ops": "aten::nonzero"})
    assert "module_cacher" not in calls.names()
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)
