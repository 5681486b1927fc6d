"""The memory features as a careful user and a careless neighbour meet them: whatever autogaudi
measures or checkpoints, the script sees what a plain run shows it — its prints, its hooks, its
random draws, BatchNorm's statistics, its keywords and its fast weights — and the report claims
only what was done."""

import copy
import json
import logging
import random

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import autogaudi
from autogaudi.watch import model_call
from tests.helpers import SCRIPTS, run_python

ONLY = "step_profiler,activation_checkpointing"  # no unit that rounds otherwise
TIGHT = 0.0005  # GiB, --memory-limit: under the tiny models' steps (they checkpoint)
ROOMY = 1.0  # GiB: above them (nothing checkpointed, the step measured only)


def unit_row():
    return autogaudi.report().unit("activation_checkpointing")


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x):
        return x + torch.relu(self.norm(self.linear(x)))


class Net(nn.Module):
    def __init__(self, blocks=4, width=32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def fit(model, steps=3, batch=128, width=32, step=None):
    """Losses of ``steps`` seeded SGD steps of ``model`` (``step(model, x)``: the loss)."""
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(batch, width)
    losses = []
    for _ in range(steps):
        loss = step(model, data) if step is not None else model(data).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def seeded(make):
    torch.manual_seed(0)
    return make()


def trained_as_plain(make, memory_limit=1e-5, **fit_args):
    """(the model ``make`` builds, trained under autogaudi with ``memory_limit`` GiB, the default
    tight enough to checkpoint; its twin trained plain): their losses asserted the same."""
    plain_model = seeded(make)
    plain = fit(plain_model, **fit_args)
    autogaudi.enable(device="cpu", memory_limit=memory_limit, only=ONLY)
    model = seeded(make)
    assert fit(model, **fit_args) == plain
    return model, plain_model


# The script: under --exact with a memory limit, tight or roomy, plain's stdout bit for bit. One
# script (its blocks BatchNorm's, random and printing, its head hooked), three interpreters.


@pytest.mark.slow
def test_under_exact_with_any_memory_limit_the_script_prints_what_plain_prints(tmp_path):
    script = SCRIPTS / "observed_batchnorm_blocks.py"
    plain = run_python(script)
    assert plain.returncode == 0, plain.stderr
    for limit in (TIGHT, ROOMY):
        report = tmp_path / f"{limit}.json"
        ours = run_python("-m", "autogaudi", "--exact", "--memory-limit", limit, "--report", report, script)
        assert ours.returncode == 0, ours.stderr
        assert ours.stdout == plain.stdout, limit
        row = next(row for row in json.loads(report.read_text())["units"] if row["name"] == "activation_checkpointing")
        assert bool(row["figures"].get("blocks_checkpointed")) == (limit == TIGHT), row  # each case is exercised


# Checkpointing: the recomputation leaves BatchNorm, Python's random state and the prints alone.


def test_a_checkpointed_recomputation_leaves_batchnorm_as_one_forward_left_it():
    model, plain_model = trained_as_plain(Net)
    assert unit_row()["figures"]["blocks_checkpointed"]
    for ours, theirs in zip(model.blocks, plain_model.blocks):
        assert int(ours.norm.num_batches_tracked) == int(theirs.norm.num_batches_tracked) == 3
        assert torch.equal(ours.norm.running_mean, theirs.norm.running_mean)
        assert torch.equal(ours.norm.running_var, theirs.norm.running_var)


class Ema(nn.Module):
    """A buffer updated through ``.data`` (an EMA codebook): no version counter moves."""

    def __init__(self, width=32):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("average", torch.zeros(width))

    def forward(self, x):
        y = self.linear(x)
        self.average.data = 0.9 * self.average.data + 0.1 * y.detach().mean(0)
        return x + torch.tanh(y)  # saves its output: a recomputation runs past the update


def test_a_recomputation_puts_back_a_buffer_updated_through_data():
    make = lambda: nn.Sequential(*(Ema() for _ in range(3)))  # noqa: E731
    model, plain_model = trained_as_plain(make)
    assert unit_row()["figures"]["blocks_checkpointed"]
    assert all(torch.equal(a.average, b.average) for a, b in zip(model, plain_model))


# The out-of-memory rescue puts back every buffer the failed forward touched, by content.


class RunsOutOnce(Net):
    def __init__(self, at):
        super().__init__()
        self.ema = Ema()
        self.left = [at]  # a counter the rescue does not put back: the failure happens once

    def forward(self, x):
        x = self.ema(x)
        for block in self.blocks:
            x = block(x)
        self.left[0] -= 1
        if self.left[0] == 0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return self.head(x)


def test_the_rescue_puts_back_batchnorm_and_data_updated_buffers():
    plain_model = seeded(lambda: RunsOutOnce(at=0))
    plain = fit(plain_model, steps=4)
    autogaudi.enable(device="cpu", memory_limit=ROOMY, only=ONLY)
    model = seeded(lambda: RunsOutOnce(at=3))
    assert fit(model, steps=4) == plain
    row = unit_row()
    assert row["reason_code"] == "rescued"
    assert row["reason_params"]["buffers"] == 1 + 3 * len(model.blocks)  # the EMA, each norm's three
    for name, buffer in plain_model.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buffer), name


# The measurement of the first step is the real step: nothing of the script runs more often.


def test_nothing_of_the_script_runs_more_often_than_in_plain(capsys):
    class Watched(Net):
        def forward(self, x):
            print("forward")
            return super().forward(x) * (1 + 0 * random.random())

    def run():
        random.seed(0)
        acts = []
        model = seeded(Watched)
        model.head.register_forward_hook(lambda module, args, output: acts.append(output.detach()))
        losses = fit(model)
        return losses, torch.stack(acts).sum().item(), random.random(), capsys.readouterr().out

    plain = run()
    autogaudi.enable(device="cpu", memory_limit=ROOMY, only=ONLY)
    assert run() == plain
    assert autogaudi.report().as_dict()["memory"]["predicted_peak_bytes"] > 0


def test_a_flop_counter_around_the_first_step_counts_what_plain_counts():
    from torch.utils.flop_counter import FlopCounterMode

    def first_step_flops():
        model = seeded(Net)
        with FlopCounterMode(display=False) as counter:
            model(torch.randn(64, 32)).pow(2).mean().backward()
        return counter.get_total_flops()

    plain = first_step_flops()
    autogaudi.enable(device="cpu", memory_limit=ROOMY, only=ONLY)
    assert first_step_flops() == plain


class CopyCounted:
    copies = 0

    def __deepcopy__(self, memo):
        CopyCounted.copies += 1
        return self


def test_nothing_of_the_model_is_copied_and_no_live_object_is_scanned(monkeypatch):
    import gc

    scans = []
    real = gc.get_objects
    monkeypatch.setattr(gc, "get_objects", lambda *args: scans.append(1) or real(*args))
    autogaudi.enable(device="cpu", memory_limit=ROOMY, only=ONLY)
    model = seeded(Net)
    model.table = CopyCounted()  # a large plain attribute would be copied with the model
    fit(model)
    assert autogaudi.report().as_dict()["memory"]["state"] == "measured"
    assert CopyCounted.copies == 0 and not scans


# The block's call passed through whole.


class Keyworded(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.seen = []

    def forward(self, x, debug=False, preserve_rng_state=None, context_fn=None, early_stop=None):
        self.seen.append((debug, preserve_rng_state, context_fn, early_stop))
        return x + torch.tanh(self.linear(x))


class KeywordNet(Net):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Keyworded() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x, debug=True, preserve_rng_state="mine", context_fn="mine", early_stop="mine")
        return self.head(x)


def test_a_checkpointed_block_gets_every_keyword_of_its_call():
    model, _ = trained_as_plain(KeywordNet)
    assert unit_row()["figures"]["blocks_checkpointed"]
    assert all(seen == (True, "mine", "mine", "mine") for block in model.blocks for seen in block.seen)


def test_a_functional_call_with_fast_weights_gets_plains_gradients():
    """MAML: an inner step's fast weights through ``torch.func.functional_call``; the outer loss's
    gradients flow through them into the module's own parameters."""

    def outer(model, x):
        params = dict(model.named_parameters())
        inner = torch.func.functional_call(model, params, (x,)).pow(2).mean()
        grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
        fast = {name: p - 0.1 * g for (name, p), g in zip(params.items(), grads)}
        return torch.func.functional_call(model, fast, (x,)).pow(2).mean()

    make = lambda: Net(blocks=3)  # noqa: E731 - no BatchNorm statistics to compare across calls
    model, plain_model = trained_as_plain(make, step=outer)
    assert unit_row()["figures"]["blocks_checkpointed"]  # the inner calls' blocks checkpointed, the outer plain
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))


# Checkpointing claimed only where it is done.


class Nested(nn.Module):
    """Blocks held in ModuleLists of ModuleLists: the outer lists' children are never called."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList(nn.ModuleList(Block() for _ in range(2)) for _ in range(2))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        for stage in self.stages:
            for block in stage:
                x = block(x)
        return self.head(x)


def test_containers_never_called_are_not_reported_checkpointed():
    model, _ = trained_as_plain(Nested)
    blocks = unit_row()["figures"]["blocks_checkpointed"]
    modules = dict(model.named_modules())
    assert blocks and all(isinstance(modules[name], Block) for name in blocks)
    assert unit_row()["figures"]["recompute_ms_per_step"] > 0


class CheckpointsItself(Net):
    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x)


def test_blocks_the_script_checkpoints_itself_are_left_to_it():
    model, _ = trained_as_plain(CheckpointsItself)
    row = unit_row()
    assert not row["figures"].get("blocks_checkpointed")
    assert all(model_call.route_of(block) is None for block in model.blocks)
    assert (
        "left_out",
        {"count": 4, "why": "the script checkpoints them itself", "total": 4, "container": "blocks"},
    ) in [(code, params) for code, params in zip(row["note_codes"], row["note_params"])]


def test_blocks_with_the_scripts_hooks_are_not_checkpointed_and_their_hooks_run_as_often_as_plain():
    def run():
        calls = []
        model = seeded(Net)
        for block in model.blocks:
            block.norm.register_forward_hook(lambda module, args, output: calls.append(1))
        return fit(model), len(calls)

    plain = run()
    autogaudi.enable(device="cpu", memory_limit=1e-5, only=ONLY)
    assert run() == plain
    row = unit_row()
    assert not row["figures"].get("blocks_checkpointed") and "left_out" in row["note_codes"]


def test_a_checkpointed_model_still_copies_as_plain():
    autogaudi.enable(device="cpu", memory_limit=1e-5, only=ONLY)
    model = seeded(Net)
    fit(model)
    assert unit_row()["figures"]["blocks_checkpointed"]
    twin = copy.deepcopy(model)
    assert all("_compiled_call_impl" not in vars(sub) for sub in twin.modules())


class Logs(Block):
    def forward(self, x):
        logging.getLogger("blocks").warning("block forward")
        return x + torch.tanh(self.linear(x))


def test_a_recomputation_logs_nothing_and_prints_nothing(caplog, capsys):
    class LogNet(Net):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Logs() for _ in range(3))

        def forward(self, x):
            print("forward")
            return super().forward(x)

    def run():
        caplog.clear()
        losses = fit(seeded(LogNet))
        return losses, len(caplog.records), capsys.readouterr()

    plain = run()
    autogaudi.enable(device="cpu", memory_limit=1e-5, only=ONLY)
    assert run() == plain
    assert unit_row()["figures"]["blocks_checkpointed"]
