"""mixed_precision: off by default; bf16 or fp16 used only after the guard compared it with float32 on
the user's own steps (which stay float32 and unchanged while it checks); fp16's loss scaling unseen by
the script (true gradients between backward and step, accumulation, overflowing steps skipped); a
script's own autocast or loss scaling is left alone; a NaN or spiking loss switches the run back to
float32; auto keeps bf16 only when its trial measured it faster."""

import io

import pytest
import torch
from torch import nn

import autogaudi
from autogaudi.core import session
from autogaudi.measure import numerics
from autogaudi.optimizations.mixed_precision import guard, loss_scale
from autogaudi.optimizations.mixed_precision import unit as mixed_precision
from autogaudi.optimizations.mixed_precision.loss_scale import INIT_SCALE
from autogaudi.watch.model_call import Layer, holder
from tests.optimizations.test_step_profiler import STEPS

UNITS = "step_profiler,mixed_precision"


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def train(net, steps, autocast=False, spoil_at=None, spoil=1.0):
    """A plain loop recording the dtype of a Linear's output; at ``spoil_at`` the loss is multiplied by ``spoil``."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    dtypes, losses = [], []
    hook = net[3].register_forward_hook(lambda _m, _a, output: dtypes.append(output.dtype))
    for step in range(steps):
        inputs, labels = torch.randn(16, 32, generator=generator), torch.randint(0, 5, (16,), generator=generator)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            output = net(inputs)
            loss = nn.functional.cross_entropy(output, labels)
        if step == spoil_at:
            loss = loss * spoil
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    hook.remove()
    return losses, dtypes, output


def row():
    return autogaudi.report().unit("mixed_precision")


def test_off_by_default_with_the_choices():
    autogaudi.enable(device="cpu")
    assert (row()["status"], row()["reason_code"]) == ("skipped", "off_by_default")
    assert row()["reason_params"]["flag"] == "--precision" and "bf16" in row()["reason_params"]["choices"]


def test_bf16_is_checked_against_float32_then_used_and_trains_alike():
    plain, _, _ = train(model(), STEPS + 20)
    autogaudi.enable(device="cpu", only=UNITS, precision="bf16")
    net = model()
    losses, dtypes, output = train(net, STEPS + 20)
    assert (row()["status"], row()["reason_code"]) == ("applied", "on"), row()
    figures = row()["figures"]
    assert figures["guard_checks"] == mixed_precision.GUARD_CHECKS
    assert figures["guard_output_error"] < guard.BOUNDS["output_error"]
    assert figures["guard_grad_cosine"] > guard.BOUNDS["grad_cosine"]
    measured = row()["numerics_measured"]  # the report says by how much the outputs moved
    assert measured["max_rel_diff"] == pytest.approx(figures["guard_output_error"], rel=1e-2)
    assert measured["steps"] == mixed_precision.GUARD_CHECKS
    steps = autogaudi.report().steps  # the guard's shadow backward passes are not the script's
    assert steps["backward_passes"] == steps["optimizer_steps"] == STEPS + 20
    # float32 through the profile and the guard's steps, bf16 after; the script sees float32 outputs
    assert dtypes[0] == torch.float32 and dtypes[-1] == torch.bfloat16
    assert output.dtype == torch.float32
    first_bf16 = dtypes.index(torch.bfloat16)
    assert losses[:first_bf16] == plain[:first_bf16]  # the guard's shadow runs changed nothing
    torch.testing.assert_close(losses, plain, rtol=0.05, atol=0.02)  # bf16 after: stated tolerance
    state = net.state_dict()
    autogaudi.disable()
    assert {tensor.dtype for tensor in state.values()} == {torch.float32}
    buffer = io.BytesIO()
    torch.save(net, buffer)  # nothing of autogaudi's on the model: a plain save and load
    assert not net._forward_hooks and not net._forward_pre_hooks
    buffer.seek(0)
    assert isinstance(torch.load(buffer, weights_only=False), nn.Sequential)


def test_beyond_the_bounds_it_is_not_used_and_the_run_is_plain_to_the_bit(monkeypatch):
    monkeypatch.setitem(guard.BOUNDS, "output_error", 0.0)
    plain, _, _ = train(model(), STEPS + 20)
    autogaudi.enable(device="cpu", only=UNITS, precision="bf16")
    net = model()
    losses, dtypes, _ = train(net, STEPS + 20)
    assert (row()["status"], row()["reason_code"]) == ("not needed", "guard_failed"), row()
    assert row()["reason_params"]["outside"] == "output_error"
    assert losses == plain and set(dtypes) == {torch.float32}
    assert not net._forward_hooks and not net._forward_pre_hooks  # nothing left on the model


def test_a_script_that_runs_autocast_itself_is_left_alone():
    autogaudi.enable(device="cpu", only=UNITS, precision="bf16")
    train(model(), STEPS + 10, autocast=True)
    assert row()["reason_code"] == "script_low_precision", row()


@pytest.mark.parametrize("spoil", [float("nan"), 100.0])
def test_a_bad_loss_switches_the_run_back_to_float32(spoil):
    autogaudi.enable(device="cpu", only=UNITS, precision="bf16")
    spoil_at = STEPS + 15
    _, dtypes, _ = train(model(), STEPS + 40, spoil_at=spoil_at, spoil=spoil)
    assert row()["reason_code"] == "fell_back", row()
    step = row()["figures"]["fell_back_at_step"]
    assert spoil_at < step <= spoil_at + mixed_precision.WATCH_EVERY + 1
    assert dtypes[-1] == torch.float32  # the steps after the fall-back ran in float32


def test_tf32_is_cuda_only():
    autogaudi.enable(device="cpu", precision="tf32")
    assert (row()["status"], row()["reason_code"], row()["reason_params"]["backends"]) == (
        "skipped",
        "other_backend",
        "cuda",
    )


def test_auto_keeps_bf16_only_when_its_trial_measured_it_faster():
    autogaudi.enable(device="cpu", only=UNITS, precision="auto")
    train(model(), STEPS + 60)
    (trial,) = autogaudi.report().trials
    assert trial["candidate"] == "mixed_precision"
    code = row()["reason_code"]
    assert code == {"kept": "measured_faster", "rejected": "rejected"}[trial["decision"]], row()


def test_a_bad_choice_names_the_valid_ones():
    with pytest.raises(autogaudi.OptionsError, match="valid choices for precision: off, auto, bf16, fp16, tf32"):
        autogaudi.enable(precision="fp8")


def test_on_hpu_the_forward_runs_under_gaudi_autocast(hpu_double):
    """The double's tensors live on the CPU, where an "hpu" autocast casts nothing: the losses stay
    those of a plain run, and what is checked is that the forward ran inside Gaudi's autocast."""
    hpu_double(lazy=True)
    plain, _, _ = train(model(), STEPS + 20)
    autogaudi.enable(device="hpu", only=UNITS, precision="bf16")
    net = model()
    inside = []
    net[3].register_forward_pre_hook(lambda _m, _a: inside.append(torch.is_autocast_enabled("hpu")))
    losses, _, _ = train(net, STEPS + 20)
    assert row()["reason_code"] == "on", row()
    assert inside[0] is False and inside[-1] is True  # float32 through profile and guard, then Gaudi's autocast
    assert losses == plain
    assert not torch.is_autocast_enabled("hpu")  # left after each forward


class Logits:
    """A custom output type the guard cannot look into."""

    def __init__(self, tensor):
        self.tensor = tensor


class Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = model()

    def forward(self, inputs):
        return Logits(self.net(inputs))


def test_outputs_the_guard_cannot_read_leave_the_run_in_float32(monkeypatch):
    monkeypatch.setattr(mixed_precision, "GUARD_PATIENCE", 8)
    autogaudi.enable(device="cpu", only=UNITS, precision="bf16")
    wrapped = Wrapped()
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    for _ in range(STEPS + 12):
        loss = nn.functional.cross_entropy(wrapped(torch.randn(8, 32)).tensor, torch.randint(0, 5, (8,)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert row()["reason_code"] == "not_checked", row()
    assert autogaudi.settled()  # a guard that gave up is not a decision still pending
    assert not wrapped._forward_hooks and not wrapped._forward_pre_hooks


@pytest.mark.parametrize("capture_first", [False, True])
def test_graph_capture_leaves_a_model_it_holds_alone(monkeypatch, capture_first):
    """Whatever the registry's order, mixed_precision decides first (graph_capture starts after it)."""
    if capture_first:
        names = [info.name for info in session.UNITS]
        assert names.index("mixed_precision") < names.index("graph_capture")
        swapped = sorted(session.UNITS, key=lambda info: info.name != "graph_capture")
        monkeypatch.setattr(session, "UNITS", tuple(swapped))
    autogaudi.enable(
        device="cpu", only="step_profiler,mixed_precision,graph_capture", precision="bf16", force="graph_capture"
    )
    net = model()
    train(net, STEPS + 20)
    assert row()["reason_code"] == "on", row()
    assert autogaudi.report().unit("graph_capture")["reason_code"] == "mixed_precision"
    assert holder(net, Layer.CAPTURE) is None and holder(net, Layer.PRECISION).name == "mixed_precision"


class ReturnsLossAndHidden(nn.Module):
    """Hugging Face's shape: the loss computed inside forward, returned in a mapping with the logits
    and an auxiliary head's output the loss does not use."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Sequential(nn.Linear(32, 64), nn.ReLU()), nn.Linear(64, 5)
        self.aux = nn.Linear(64, 3)

    def forward(self, inputs, labels):
        hidden = self.body(inputs)
        logits = self.head(hidden)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits, "aux": self.aux(hidden)}


def test_a_forward_that_returns_its_loss_and_unused_outputs_is_checked():
    autogaudi.enable(device="cpu", only=UNITS, precision="bf16")
    torch.manual_seed(0)
    net = ReturnsLossAndHidden()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for _ in range(STEPS + 10):
        output = net(torch.randn(16, 32), torch.randint(0, 5, (16,)))
        output["loss"].backward()
        optimizer.step()
        optimizer.zero_grad()
    assert row()["reason_code"] == "on", row()
    assert row()["figures"]["guard_checks"] == mixed_precision.GUARD_CHECKS
    assert {value.dtype for value in output.values()} == {torch.float32}  # handed back in float32


def test_a_model_the_script_compiles_is_left_alone():
    autogaudi.enable(device="cpu", only=UNITS, precision="bf16")
    net = model()
    net.compile(backend="eager")  # dynamo's tracing without code generation: cheap on the CPU
    _, dtypes, _ = train(net, STEPS + 10)
    assert row()["reason_code"] == "compiled_by_script", row()
    assert set(dtypes) == {torch.float32}


def train_fp16(net, steps, accumulate=1, loss_factor=1.0, grad_factor=None):
    """A float32 loop that records, before each optimizer step, the gradient norm the script sees and
    the dtype a Linear ran in. ``grad_factor``: steps counted from the run's first step in fp16 ->
    factor multiplying the gradient at the model's output in that step (the loss stays as it is: an
    overflow the watch cannot see). Counted in the same run: when fp16 starts depends on how many
    census pairs the step profile took, which the machine's timing decides."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    norms, dtypes, losses, params, states = [], [], [], [], []
    hook = net[3].register_forward_hook(lambda _m, _a, output: dtypes.append(output.dtype))
    for step in range(steps):
        for _ in range(accumulate):
            inputs, labels = torch.randn(16, 32, generator=generator), torch.randint(0, 5, (16,), generator=generator)
            output = net(inputs)
            in_fp16 = step - first_fp16_step({"dtypes": dtypes}, accumulate) if torch.float16 in dtypes else None
            if grad_factor and in_fp16 in grad_factor:
                output.register_hook(lambda grad, factor=grad_factor[in_fp16]: grad * factor)
            loss = nn.functional.cross_entropy(output, labels) * loss_factor
            loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), 1e9).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        params.append(torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()]))
        states.append(int(optimizer.state[net[0].weight]["step"]))
    hook.remove()
    return {"norms": norms, "dtypes": dtypes, "losses": losses, "params": params, "states": states}


def first_fp16_step(run, accumulate=1):
    return run["dtypes"].index(torch.float16) // accumulate


@pytest.mark.parametrize("loss_factor", [1.0, 1e-7])
def test_fp16_is_checked_then_used_with_loss_scaling_the_script_does_not_see(loss_factor):
    """At 1e-7 most output gradients (about 5e-9) are below fp16's smallest subnormal (6e-8): without
    the loss scale the fp16 backward would lose them."""
    steps = STEPS + 30
    plain = train_fp16(model(), steps, loss_factor=loss_factor)
    autogaudi.enable(device="cpu", only=UNITS, precision="fp16")
    net = model()
    run = train_fp16(net, steps, loss_factor=loss_factor)
    assert (row()["status"], row()["reason_code"]) == ("applied", "on"), row()
    assert "with loss scaling" in row()["changes"][0]
    figures = row()["figures"]
    assert figures["guard_grad_cosine"] > guard.BOUNDS["grad_cosine"]
    assert (figures["loss_scale"], figures["skipped_steps"]) == (INIT_SCALE, 0)
    first = first_fp16_step(run)
    assert run["dtypes"][-1] == torch.float16
    assert run["losses"][:first] == plain["losses"][:first]  # float32, bit for bit, until fp16 is on
    # the first fp16 step starts from plain's weights: the gradient the script clips is plain's, unscaled
    assert run["norms"][first] == pytest.approx(plain["norms"][first], rel=0.01)
    torch.testing.assert_close(run["losses"], plain["losses"], rtol=0.02, atol=0.01 * loss_factor)
    state = net.state_dict()
    autogaudi.disable()
    assert {tensor.dtype for tensor in state.values()} == {torch.float32}


def test_fp16_accumulated_gradients_are_those_of_float32():
    """Two backward passes per step: the first's gradients, already unscaled, are scaled again before
    the second and unscaled with it (without that, the sum would be the second's alone, plus a 2**-16th)."""
    plain = train_fp16(model(), STEPS + 20, accumulate=2)
    autogaudi.enable(device="cpu", only=UNITS, precision="fp16")
    run = train_fp16(model(), STEPS + 20, accumulate=2)
    assert row()["reason_code"] == "on", row()
    first = first_fp16_step(run, accumulate=2)
    assert run["norms"][first] == pytest.approx(plain["norms"][first], rel=0.01)
    torch.testing.assert_close(run["losses"], plain["losses"], rtol=0.02, atol=0.01)


def test_an_overflowing_fp16_step_is_skipped_and_the_scale_halves():
    autogaudi.enable(device="cpu", only=UNITS, precision="fp16")
    run = train_fp16(model(), STEPS + 12, grad_factor={2: 1e4})
    overflow_at = first_fp16_step(run) + 2
    assert row()["reason_code"] == "on", row()
    # 0.06 * 1e4 * 2**16 is far beyond fp16's 65504: that step's gradients are inf, so the step is skipped
    assert torch.equal(run["params"][overflow_at], run["params"][overflow_at - 1])
    assert run["states"][overflow_at] == run["states"][overflow_at - 1]  # AdamW's state untouched too
    assert not torch.equal(run["params"][overflow_at + 1], run["params"][overflow_at])  # and training goes on
    assert (row()["figures"]["loss_scale"], row()["figures"]["skipped_steps"]) == (INIT_SCALE / 2, 1)


def test_fp16_gives_up_after_steps_that_overflow_at_every_scale():
    steps = STEPS + 10 + mixed_precision.SKIPS_IN_A_ROW + 10
    autogaudi.enable(device="cpu", only=UNITS, precision="fp16")
    run = train_fp16(model(), steps, grad_factor={step: float("inf") for step in range(steps)})
    first = first_fp16_step(run)
    assert row()["reason_code"] == "fell_back", row()
    # in the eighth skipped step (numbered from 0, as the session counts the steps before it)
    assert row()["figures"]["fell_back_at_step"] == first + mixed_precision.SKIPS_IN_A_ROW - 1
    assert row()["figures"]["skipped_steps"] == mixed_precision.SKIPS_IN_A_ROW
    assert run["dtypes"][-1] == torch.float32
    # every step from the first in fp16 skipped: the weights are those fp16 started from
    assert torch.equal(run["params"][first + mixed_precision.SKIPS_IN_A_ROW - 1], run["params"][first - 1])


def test_a_script_that_scales_its_loss_keeps_fp16_off():
    autogaudi.enable(device="cpu", only=UNITS, precision="fp16")
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(STEPS + 10):
        loss = nn.functional.cross_entropy(net(torch.randn(8, 32)), torch.randint(0, 5, (8,)))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert row()["reason_code"] == "script_scaler", row()
    assert not net._forward_hooks and not net._forward_pre_hooks


@pytest.mark.parametrize(
    ("asked", "has_bf16", "chosen"),
    [("auto", True, "bf16"), ("auto", False, "fp16"), ("fp16", True, "fp16"), ("bf16", False, "bf16")],
)
def test_auto_takes_bf16_where_the_device_has_it_else_fp16(asked, has_bf16, chosen):
    assert mixed_precision.chosen_precision(asked, has_bf16) == chosen


def test_fp16_on_hpu_is_declined_for_bf16(hpu_double):
    hpu_double(lazy=True)
    autogaudi.enable(device="hpu", precision="fp16")
    assert (row()["status"], row()["reason_code"]) == ("skipped", "no_fp16")


def test_loss_scaling_functions_scale_unscale_exactly_and_follow_gradscalers_rule():
    grads = [torch.randn(3, 4), torch.randn(5)]
    before = [g.clone() for g in grads]
    grouped = {torch.device("cpu"): grads}
    scale = torch.tensor(2.0**16)
    loss_scale.scale_gradients(grouped, scale)
    assert torch.equal(grads[0], before[0] * 2.0**16)
    loss_scale.unscale_gradients(grouped, scale)
    assert all(torch.equal(g, b) for g, b in zip(grads, before))  # a power of two: exact both ways
    assert loss_scale.non_finite(grouped, "cpu").item() == 0.0
    grads[1][2] = float("inf")
    assert loss_scale.non_finite(grouped, "cpu").item() == 1.0
    tracker = torch.zeros((), dtype=torch.int32)
    loss_scale.update_scale(scale, tracker, torch.ones(()), interval=2)
    assert scale.item() == 2.0**15  # an overflow halves it
    for _ in range(2):
        loss_scale.update_scale(scale, tracker, torch.zeros(()), interval=2)
    assert scale.item() == 2.0**16  # two clean steps in a row double it


def test_the_guards_copy_leaves_the_scripts_hooks_and_follows_the_models_weights():
    net = model()
    calls = []
    net[0].register_forward_hook(lambda *_: calls.append("hook"))
    shadow = numerics.plain_copy(net)
    shadow(torch.randn(2, 32))
    assert calls == [] and len(net[0]._forward_hooks) == 1  # the script's hook stays on its model only
    with torch.no_grad():
        net[0].weight.add_(1.0)
    net[2].eval()
    assert not torch.equal(shadow[0].weight, net[0].weight)
    numerics.sync_copy(shadow, net)
    assert torch.equal(shadow[0].weight, net[0].weight) and shadow[0].weight is not net[0].weight
    assert shadow.training and not shadow[2].training  # each submodule's mode, as the script set it


def test_the_guards_shadow_steps_hold_the_steps_windows_until_it_decided():
    """The shadow steps on a copy run inside the user's steps: no other measurement may time them."""
    from autogaudi.entry import runtime

    autogaudi.enable(device="cpu", only=UNITS, precision="bf16")
    net, holders = model(), []
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for _ in range(STEPS + 20):
        nn.functional.cross_entropy(net(torch.randn(16, 32)), torch.randint(0, 5, (16,))).backward()
        optimizer.step()
        optimizer.zero_grad()
        holders.append(runtime._STATE.session.windows.holder_name() if runtime._STATE.session.windows.holder else None)
    assert row()["reason_code"] == "on"
    checking = [index for index, holder in enumerate(holders) if holder == "mixed_precision"]
    assert len(checking) >= mixed_precision.GUARD_CHECKS - 1 and holders[-1] is None, holders
