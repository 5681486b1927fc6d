"""The steps' measurement windows: one holder at a time, refreshed by measuring, lost when stale."""

from autogaudi import step_windows
from tests.test_trials import FakeSteps, FakeUnit


def test_one_holder_at_a_time_until_it_releases():
    steps = FakeSteps()
    windows, first, second = step_windows.StepWindows(steps), FakeUnit(), FakeUnit()
    assert windows.take(first) and windows.take(first)  # taking again refreshes
    assert not windows.take(second) and windows.holder is first
    windows.release(second)  # only the holder releases
    assert windows.holder is first
    windows.release(first)
    assert windows.take(second) and windows.holder is second


def test_a_hold_not_refreshed_for_stale_steps_is_lost_to_the_next_asker():
    """An optimizer timed until it stopped stepping must not hold every other measurement back."""
    steps = FakeSteps()
    windows, stopped, asker = step_windows.StepWindows(steps), FakeUnit(), FakeUnit()
    assert windows.take(stopped)
    for _ in range(step_windows.STALE_STEPS - 1):
        steps.end_step()
        assert not windows.take(asker)
    steps.end_step()
    assert windows.take(asker) and windows.holder is asker


def test_a_yielding_hold_is_taken_by_any_asker_at_once_and_then_waits():
    """A loader's windows measure for one rank only: the census and the trials, which start at the
    same step on every rank, never wait for them."""
    steps = FakeSteps()
    windows, loader, census = step_windows.StepWindows(steps), FakeUnit(), FakeUnit()
    assert windows.take(loader, yields=True) and windows.take(loader, yields=True)
    assert windows.take(census) and windows.holder is census
    assert not windows.take(loader, yields=True)
    windows.release(census)
    assert windows.take(loader, yields=True)


def test_a_unit_switched_off_gives_the_steps_back_whatever_it_was_measuring():
    """The session's revert releases the windows, as it cancels the unit's trials: a fused update
    still timed when its unit fails holds nothing after."""
    import torch

    import autogaudi
    from autogaudi import runtime

    autogaudi.enable(device="cpu", only="fused_optimizer")
    session = runtime._STATE.session
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    unit = session.unit("fused_optimizer")
    assert session.windows.holder is unit  # timing its fused update against torch's
    unit.failed_at_run_time(RuntimeError("injected"))
    assert session.windows.holder is None
