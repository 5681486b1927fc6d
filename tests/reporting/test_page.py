"""The report as a person sees it: the page --report run.html writes, drawn by a real browser, and
the facts the short report rests on (bounded timeline, a trial cut short is no change)."""

import gc
import json
import shutil
import subprocess

import pytest
import torch
from torch import nn

import autogaudi
from autogaudi.entry import runtime
from autogaudi.measure.timeline import MAX_EVENTS, MAX_POINTS, Timeline
from tests.helpers import SCRIPTS, run_python
from tests.optimizations.test_channels_last import cnn

BROWSER = next(
    (shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome") if shutil.which(name)), None
)
needs_browser = pytest.mark.skipif(
    BROWSER is None, reason="no headless Chromium here (apt-get install chromium): the page is not drawn"
)


def browse(page, *flags) -> subprocess.CompletedProcess:
    return subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", *flags, page.as_uri()],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    """The page of a real launcher run: --report PATH.html selects the page over JSON."""
    path = tmp_path_factory.mktemp("page") / "run.html"
    result = run_python("-m", "autogaudi", "--report", path, SCRIPTS / "train_tiny.py")
    assert result.returncode == 0, result.stderr
    return path


def test_the_page_is_one_file_with_nothing_fetched(page):
    text = page.read_text()
    assert text.startswith("<!DOCTYPE html>") and "report (torch" in text  # the short report is on it
    for fetch in ("src=", "href=", "url(", "@import"):
        assert fetch not in text


@needs_browser
def test_a_browser_draws_one_chart_point_per_step(page, tmp_path):
    """Chromium runs the page: the chart's line has a point for each of the run's 10 steps and a size
    on the screen, and the screenshot is more than the background."""
    dom = browse(page, "--dump-dom")
    marker = 'data-drawn="'
    drawn = json.loads(dom.stdout.split(marker, 1)[1].split('"', 1)[0].replace("&quot;", '"'))
    assert drawn["points"] == 10 and drawn["width"] > 100 and drawn["height"] > 0, drawn
    image = pytest.importorskip("PIL.Image")
    shot = tmp_path / "page.png"
    browse(page, f"--screenshot={shot}", "--window-size=1000,500")
    colours = image.open(shot).convert("RGB").getcolors(maxcolors=1 << 16)
    assert colours is not None and len(colours) > 10  # text, the line, the shaded warm-up: not one colour


def test_the_timeline_stays_bounded_and_keeps_the_run_s_time():
    timeline = Timeline()
    for step in range(5 * MAX_POINTS + 3):
        timeline.step(0.001 * (1 + step % 2))
        timeline.mark(step, "unit", "event")
    data = timeline.as_dict()
    assert len(data["step_s"]) <= MAX_POINTS and data["every"] == 8
    assert timeline.seconds == pytest.approx(0.0015 * (5 * MAX_POINTS + 3), rel=1e-3)
    assert len(data["events"]) == MAX_EVENTS and data["events_left_out"] == 5 * MAX_POINTS + 3 - MAX_EVENTS


def test_a_timeline_step_leaves_the_garbage_collector_nothing_to_track():
    """A tracked object kept per step would bring a full collection into short runs (timeline.py)."""
    timeline = Timeline()
    was_enabled = gc.isenabled()
    gc.disable()  # no collection between the two counts
    try:
        tracked = len(gc.get_objects())
        for _ in range(3 * MAX_POINTS):
            timeline.step(0.001)
        kept = len(gc.get_objects()) - tracked
    finally:
        (gc.enable if was_enabled else gc.disable)()
    assert kept < 10


def test_a_run_that_ends_during_a_trial_changed_nothing(step_clock):
    """A candidate on trial is on in some steps only: not listed as changed; the run says the trial
    was cut short, and the chart shades it from its start."""
    autogaudi.enable(device="cpu", only="step_profiler,channels_last", trial="channels_last")
    model = cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    unit = runtime._STATE.session.unit("channels_last")
    for _ in range(200):
        nn.functional.cross_entropy(model(torch.randn(8, 3, 16, 16)), torch.randint(0, 4, (8,))).backward()
        optimizer.step()
        optimizer.zero_grad()
        step_clock.advance(0.01)
        if unit.candidate.on:  # the candidate's arm is running
            break
    report = autogaudi.report().as_dict()
    assert unit.candidate.on and report["changed"] == [] and report["summary"]["unfinished"] == ["channels_last"]
    assert [event["event"] for event in report["timeline"]["events"]] == ["profiled", "trial_started"]


def test_the_first_step_and_evaluations_are_on_the_chart():
    """The first step is shaded as such (it holds the first forward and lazy initialisation), and an
    evaluation after a step is marked there with its count of passes."""
    from autogaudi.reporting import page

    timeline = Timeline()
    for _ in range(4):
        timeline.step(0.01)
    timeline.add_to_mark(2, "steps", "evaluated", passes=3)
    timeline.add_to_mark(2, "steps", "evaluated", passes=2)  # no_grad entered per batch: one mark
    data = {"steps": {"warmup_steps": 1}, "trials": [], "timeline": timeline.as_dict()}
    assert data["timeline"]["events"] == [{"step": 2, "unit": "steps", "event": "evaluated", "passes": 5}]
    assert (0, 1, page.ARM_COLOURS["first"]) in [span[:3] for span in page._spans(data, 4)]
    assert [step for step, _ in page._marks(data)] == [2]
    assert f'fill="{page.ARM_COLOURS["first"]}"' in page.chart(data)


def test_a_trials_mark_carries_its_spread_where_measured():
    from autogaudi.reporting import page

    record = {"candidate": "graph_capture", "decision": "kept", "speedup": 1.09, "steps": 21, "started_at_step": 3}
    data = {"steps": {}, "trials": [record, {**record, "spread_with": 0.03, "spread_without": 0.04}]}
    assert {words for _, words in page._marks(data)} == {
        "graph_capture: kept (1.09x)",
        "graph_capture: kept (1.09x ±5%)",
    }
