"""shape_buckets: buckets with the fewest padded positions, batches padded with their own padding
values, and in a run: a masked classifier's calls bucketed where capture is on (its losses plain's
within the check's tolerance), an unmasked mean refused and trained as plain, nothing padded eagerly;
on the HPU double's lazy mode, a graph per new shape, and none after warm-up once bucketed."""

import collections
import importlib.util
import itertools
import json
import pathlib
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import autogaudi
from autogaudi.backends.cpu import CpuBackend
from autogaudi.optimizations.shape_buckets import buckets, padding, signature
from tests.helpers import HPU_DOUBLE, clean_env, run_python
from tests.optimizations.test_step_profiler import STEPS

SCRIPTS = pathlib.Path(__file__).parents[1] / "scripts"


def script_module(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def classifier_script(monkeypatch, pool: str):
    monkeypatch.setenv("POOL", pool)
    return script_module("bucket_classifier")


def train(script, steps: int) -> list:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(script.samples(8 * steps, generator), batch_size=8, shuffle=True, collate_fn=script.collate)
    model = script.Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for batch in loader:
        loss = torch.nn.functional.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.fixture
def cheap_capture(monkeypatch):
    """Identity graphs: capture's layer is on the model (shapes matter) without a compiler's seconds."""
    monkeypatch.setattr(CpuBackend, "graph_forward", lambda self, module, **kwargs: module._call_impl)


def padded(lengths, chosen) -> int:
    return sum(buckets.bucket_for(length, chosen) - length for length in lengths)


def test_buckets_pad_the_fewest_positions_for_a_number_of_graphs():
    lengths = [10, 11, 12, 12, 30, 31, 40, 50, 64, 64, 64]
    chosen = buckets.fewest_padded(collections.Counter(lengths), 3)
    distinct = sorted(set(lengths))
    best = min(
        (c for k in (1, 2, 3) for c in itertools.combinations(distinct, k) if max(distinct) in c),
        key=lambda c: padded(lengths, c),
    )
    assert len(chosen) <= 3 and chosen[-1] == 64 and padded(lengths, chosen) == padded(lengths, best)
    assert buckets.fewest_padded(collections.Counter([9, 5, 9]), 8) == (5, 9)  # as few lengths as graphs
    assert buckets.bucket_for(65, chosen) is None and buckets.overflow(65) == 72


def test_the_fewest_graphs_whose_padding_stays_within_the_budget():
    near = [57, 58, 60, 61, 62, 63, 64, 64]  # a batch's longest sequence: near the longest there is
    assert buckets.choose(near, 8) == (64,)
    spread = list(range(8, 65, 4))
    chosen = buckets.choose(spread, 8)
    assert 1 < len(chosen) <= 8
    assert padded(spread, chosen) <= buckets.PADDING_BUDGET * sum(buckets.bucket_for(n, chosen) for n in spread)
    assert padded(spread, chosen[:-2] + chosen[-1:]) > padded(spread, chosen)


def test_a_batch_is_padded_with_its_own_padding_values_and_outputs_cut_back():
    ids = torch.tensor([[5, 6, 7], [8, 3, 3]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    labels = torch.tensor([[1, 2, 3], [4, -100, -100]])
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "label": torch.tensor([1, 0])}
    rows, length, plan = padding.fills(signature.named_tensors(batch), {}, None)
    assert (rows, length, plan) == (2, 3, {"input_ids": 3, "attention_mask": 0, "labels": -100})
    args, kwargs = padding.padded_call(lambda **kw: None, (), batch, plan, 5)
    assert kwargs["input_ids"].tolist() == [[5, 6, 7, 3, 3], [8, 3, 3, 3, 3]]
    assert kwargs["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    assert kwargs["labels"][:, 3:].eq(-100).all() and kwargs["label"] is batch["label"]
    output = {"logits": torch.zeros(2, 5, 4), "pooled": torch.zeros(2, 4)}
    cut = padding.cut_back(output, rows, length, 5)
    assert cut["logits"].shape == (2, 3, 4) and cut["pooled"].shape == (2, 4)


def test_a_batch_that_does_not_say_its_padding_is_not_padded():
    ids = torch.tensor([[5, 6, 7], [8, 3, 4]])
    with pytest.raises(padding.NotPadded) as no_mask:
        padding.fills([("input_ids", ids)], {}, None)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    with pytest.raises(padding.NotPadded) as not_constant:
        padding.fills([("input_ids", ids), ("attention_mask", mask)], {}, None)
    assert (no_mask.value.code, not_constant.value.code) == ("no_mask", "fill_not_constant")


def test_where_shapes_vary_tells_an_epochs_end_from_a_sequence():
    def sig(*shape):
        return signature.signature(({"x": torch.zeros(shape)},), {})

    assert signature.where_it_varies([sig(8, 4), sig(8, 4)]) == "static"
    assert signature.where_it_varies([sig(8, 4), sig(3, 4)]) == "batch"
    assert signature.where_it_varies([sig(8, 4), sig(8, 9), sig(3, 9)]) == "sequence"


def test_a_masked_classifier_is_bucketed_under_capture_with_plain_losses(monkeypatch, cheap_capture):
    script = classifier_script(monkeypatch, "masked")
    plain = train(script, STEPS + 12)
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture,shape_buckets", force="graph_capture")
    losses = train(script, STEPS + 12)
    row = autogaudi.report().unit("shape_buckets")
    shapes = autogaudi.report().as_dict()["shapes"]
    assert row["reason_code"] == "bucketed" and row["status"] == "applied"
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=0)
    assert len(shapes["buckets"]) <= 8 and shapes["distinct_after"] <= len(shapes["buckets"])
    assert shapes["distinct_before"] > shapes["distinct_after"] and shapes["padded_fraction"] > 0
    assert autogaudi.report().unit("graph_capture")["status"] == "applied"  # not switched off for its shapes


def test_an_unmasked_mean_is_refused_and_trains_as_plain(monkeypatch, cheap_capture):
    script = classifier_script(monkeypatch, "unmasked")
    plain = train(script, STEPS + 6)
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture,shape_buckets", force="graph_capture")
    losses = train(script, STEPS + 6)
    row = autogaudi.report().unit("shape_buckets")
    assert row["reason_code"] == "padding_moves_result" and row["status"] == "not needed"
    assert losses == plain
    assert autogaudi.report().as_dict()["shapes"]["padded_fraction"] == 0.0


def test_the_scripts_own_compile_gets_buckets(monkeypatch):
    script = classifier_script(monkeypatch, "masked")
    autogaudi.enable(device="cpu", only="step_profiler,shape_buckets")
    monkeypatch.setattr(script, "Classifier", lambda make=script.Classifier: torch.compile(make(), backend="eager"))
    train(script, STEPS + 6)
    shapes = autogaudi.report().as_dict()["shapes"]
    assert autogaudi.report().unit("shape_buckets")["reason_code"] == "bucketed"
    assert shapes["distinct_after"] <= len(shapes["buckets"]) < shapes["distinct_before"]


def test_the_scripts_own_compile_of_an_unmasked_mean_gets_a_dynamic_sequence_dimension(monkeypatch):
    script = classifier_script(monkeypatch, "unmasked")
    compiled = lambda make=script.Classifier: torch.compile(make(), backend="eager")  # noqa: E731
    monkeypatch.setattr(script, "Classifier", compiled)
    plain = train(script, STEPS + 6)
    torch._dynamo.reset()
    autogaudi.enable(device="cpu", only="step_profiler,shape_buckets")
    losses = train(script, STEPS + 6)
    row = autogaudi.report().unit("shape_buckets")
    assert row["reason_code"] == "marked_dynamic" and row["reason_params"]["refused"] == "padding_moves_result"
    assert row["reason_params"]["names"] == str(["attention_mask", "input_ids"]) and row["status"] == "applied"
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=0)


def test_nothing_is_padded_on_an_eager_run(monkeypatch):
    script = classifier_script(monkeypatch, "masked")
    autogaudi.enable(device="cpu", only="step_profiler,shape_buckets")
    train(script, STEPS + 2)
    row = autogaudi.report().unit("shape_buckets")
    assert row["reason_code"] == "eager" and row["status"] == "not needed"
    assert autogaudi.report().as_dict()["shapes"]["distinct_before"] > 1


def trainer_losses(script, folder, steps: int, seen=None) -> tuple:
    folder.mkdir()
    run = script.trainer(str(folder), steps)
    if seen is not None:  # the lengths that reach the model's own call, training and evaluation
        run.model.register_forward_pre_hook(
            lambda _m, _args, kwargs: seen.append((torch.is_grad_enabled(), kwargs["input_ids"].shape[1])),
            with_kwargs=True,
        )
    run.train()
    losses = [entry["loss"] for entry in run.state.log_history if "loss" in entry]
    return losses, run.evaluate()["eval_loss"]


def test_a_trainer_with_a_padding_collator_is_bucketed_evaluation_included(cheap_capture, tmp_path):
    pytest.importorskip("transformers")
    script = script_module("bucket_bert_trainer")
    plain, plain_eval = trainer_losses(script, tmp_path / "plain", STEPS + 8)
    autogaudi.enable(device="cpu", only="step_profiler,graph_capture,shape_buckets", force="graph_capture")
    seen = []
    losses, evaluated = trainer_losses(script, tmp_path / "run", STEPS + 8, seen)
    shapes = autogaudi.report().as_dict()["shapes"]
    assert autogaudi.report().unit("shape_buckets")["reason_code"] == "bucketed"
    torch.testing.assert_close(losses, plain, rtol=1e-3, atol=0)
    torch.testing.assert_close(evaluated, plain_eval, rtol=1e-3, atol=0)
    evaluation = {length for training, length in seen if not training}
    assert evaluation and evaluation <= set(shapes["buckets"])
    assert {length for training, length in seen[-8:] if training} <= set(shapes["buckets"])


def test_on_hpu_lazy_mode_a_masked_classifier_is_bucketed_with_plain_losses(monkeypatch, hpu_double):
    script = classifier_script(monkeypatch, "masked")
    plain = train(script, STEPS + 6)
    hpu_double(lazy=True)
    autogaudi.enable(device="hpu", only="step_profiler,shape_buckets")
    losses = train(script, STEPS + 6)
    shapes = autogaudi.report().as_dict()["shapes"]
    assert autogaudi.report().unit("shape_buckets")["reason_code"] == "bucketed"
    torch.testing.assert_close(losses, plain, rtol=1e-5, atol=0)
    assert shapes["distinct_after"] <= len(shapes["buckets"]) < shapes["distinct_before"]


def compilations() -> int:
    metrics = sys.modules["habana_frameworks.torch.hpu.metrics"]
    return dict(metrics.metric_global("graph_compilation").stats())["TotalNumber"]


def test_the_double_in_lazy_mode_compiles_a_graph_per_new_shape(hpu_double):
    hpu_double(lazy=True)
    core = sys.modules["habana_frameworks.torch.core"]
    model = torch.nn.Linear(4, 2).to("hpu")
    core.mark_step()  # the parameters' copies: a graph of their own
    counts = []
    for rows in (8, 8, 3, 8, 3):
        model(torch.randn(rows, 4).to("hpu")).sum().backward()
        core.mark_step()
        counts.append(compilations())
    first = counts[0]
    assert counts == [first, first, first + 1, first + 1, first + 1]  # a shape seen before is a cache hit
    model(torch.randn(5, 4).to("hpu")).sum().item()  # a read to the host runs the graph queued so far
    assert compilations() == first + 2
    torch.nn.Linear(4, 2)(torch.randn(5, 4)).sum().backward()  # host tensors: no graph
    core.mark_step()
    assert compilations() == first + 2


CUDA_CLASSIFIER = """
import sys
sys.path.insert(0, {scripts!r})
import torch
from torch.utils.data import DataLoader
from bucket_classifier import BATCH, Classifier, collate, samples

torch.manual_seed(0)
generator = torch.Generator().manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
loader = DataLoader(samples({steps} * BATCH, generator), batch_size=BATCH, shuffle=True, collate_fn=collate)
model = Classifier().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for batch in loader:
    batch = {{key: value.to(device) for key, value in batch.items()}}
    loss = torch.nn.functional.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


@pytest.mark.slow
def test_a_classifier_written_for_cuda_compiles_nothing_after_warm_up_in_lazy_mode(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(CUDA_CLASSIFIER.format(scripts=str(SCRIPTS), steps=STEPS + 8))
    report = tmp_path / "report.json"
    env = clean_env(PYTHONPATH=str(HPU_DOUBLE), HPU_DOUBLE_RELEASE="1.19")
    result = run_python("-m", "autogaudi", "--report", report, script, env=env)
    assert result.returncode == 0, result.stderr
    shapes = json.loads(report.read_text())["shapes"]
    assert shapes["compilations_after_warmup"] == 0 and 0 < shapes["padded_fraction"] <= 0.15
    assert shapes["distinct_after"] <= len(shapes["buckets"]) < shapes["distinct_before"]
