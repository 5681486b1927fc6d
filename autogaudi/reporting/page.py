"""The report as one page (``--report run.html``): the run's step time over the whole run, with the
moments autogaudi acted marked on it, then the short report and every unit's row.

Why one self-contained file: it is opened from a cluster's disk, a CI artifact or a mail, often where
nothing outside can be fetched, so the chart is inline SVG drawn here from the report's ``timeline``
(no script, no style sheet or font from elsewhere). A small inline script only reads what the
browser drew (the chart's size and point count) into the page's ``data-drawn`` attribute, which the
test in a headless browser checks.
"""

from __future__ import annotations

import html
import json
import statistics

from autogaudi.reporting.effects import spread
from autogaudi.reporting.text import format_speedup

WIDTH, HEIGHT = 960, 300
LEFT, RIGHT, TOP, BOTTOM = 60, 20, 20, 40
# step-time outliers (one-offs: a compile) beyond this many medians are drawn at the top edge, so the
# steady steps stay readable
CLIP_MEDIANS = 5
ARM_COLOURS = {"without": "#cfe3ff", "with": "#c9f2d0", "warm-up": "#ffd9a8", "first": "#f3c4c4"}
FIRST_STEP_FROM = {
    "batch": "first step, from its batch: its forward and lazy initialisation included",
    "start": "first step, from autogaudi's start: set-up before the loop included",
}
RANK_COLOURS = ("#9c9c9c", "#b38bd9", "#d98b8b", "#8bbfd9", "#c9b458")
EVENT_WORDS = {
    "profiled": "step profiled",
    "trial_started": "trial starts",
    "workers": "loader to workers",
    "in_process": "loader back in-process",
    "fell_back": "precision fell back",
    "failed": "failed, switched off",
    "evaluated": "evaluation forward passes (no gradients; not steps)",
}


def render(report) -> str:
    """The page for ``report`` (a :class:`~autogaudi.reporting.record.Report`)."""
    data = report.as_dict()
    title = f"autogaudi report: {data['steps'].get('steps', 0)} training steps on {data['backend']['name']}"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #222; }}
pre {{ background: #f6f6f6; padding: 12px; white-space: pre-wrap; font-size: 12px; }}
table {{ border-collapse: collapse; font-size: 12px; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }}
svg text {{ font: 11px system-ui, sans-serif; fill: #444; }}
.legend span {{ display: inline-block; padding: 0 8px; margin-right: 6px; }}
</style></head>
<body data-drawn="">
<h1>{html.escape(title)}</h1>
{chart(data)}
<h2>Report</h2>
<pre>{html.escape(report.format(verbose=False))}</pre>
<h2>Every unit</h2>
{unit_table(data["units"])}
<h2>Trials</h2>
<pre>{html.escape(json.dumps(data["trials"], indent=1)) if data["trials"] else "none"}</pre>
<script>
(function () {{
  var line = document.getElementById("steps");
  var box = line ? line.getBBox() : {{width: 0, height: 0}};
  document.body.setAttribute("data-drawn", JSON.stringify({{
    points: line ? line.points.numberOfItems : 0, width: box.width, height: box.height}}));
}})();
</script>
</body></html>
"""


def chart(data: dict) -> str:
    """The step-time chart as inline SVG: shaded spans (warm-up, each trial's arms), marks (the
    moments units acted, decisions), this rank's steps and, in a multi-rank run, the other ranks'."""
    timeline = data.get("timeline") or {}
    values = timeline.get("step_s") or []
    if not values:
        return "<p>No training step was timed: no chart.</p>"
    every = timeline["every"]
    steps = len(values) * every
    ranks = {rank: got for rank, got in (timeline.get("ranks") or {}).items() if got and got["step_s"] and rank != "0"}
    highest = max([max(values)] + [max(got["step_s"]) for got in ranks.values()])
    top = min(CLIP_MEDIANS * statistics.median(values), highest) * 1000 or 1.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(step: float) -> float:
        return round(LEFT + plot_w * step / max(steps, 1), 1)

    def y(ms: float) -> float:
        return round(TOP + plot_h * (1 - min(ms, top) / top), 1)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" role="img">']
    for start, end, colour, label in _spans(data, steps):
        parts.append(
            f'<rect x="{x(start)}" y="{TOP}" width="{max(0.5, x(end) - x(start))}" height="{plot_h}" '
            f'fill="{colour}"><title>{html.escape(label)}</title></rect>'
        )
    parts.append(
        f'<line x1="{LEFT}" y1="{TOP + plot_h}" x2="{LEFT + plot_w}" y2="{TOP + plot_h}" stroke="#888"/>'
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + plot_h}" stroke="#888"/>'
        f'<text x="{LEFT - 6}" y="{TOP + 10}" text-anchor="end">{_duration(top)}</text>'
        f'<text x="{LEFT - 6}" y="{TOP + plot_h}" text-anchor="end">0</text>'
        f'<text x="{LEFT}" y="{HEIGHT - 18}">step 1</text>'
        f'<text x="{LEFT + plot_w}" y="{HEIGHT - 18}" text-anchor="end">step {steps}</text>'
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 4}" text-anchor="middle">training step (ms per step'
        f"{'' if every == 1 else f', mean of {every}'})</text>"
    )
    for index, (rank, got) in enumerate(sorted(ranks.items())):
        parts.append(_line(got["step_s"], got["every"], x, y, RANK_COLOURS[index % len(RANK_COLOURS)], f"rank {rank}"))
    parts.append(_line(values, every, x, y, "#1f4fa8", "this rank", element_id="steps"))
    for step, label in _marks(data):
        parts.append(
            f'<line x1="{x(step)}" y1="{TOP}" x2="{x(step)}" y2="{TOP + plot_h}" stroke="#c0392b" '
            f'stroke-dasharray="3,3"><title>{html.escape(label)}</title></line>'
        )
    parts.append("</svg>")
    legend = "".join(
        f'<span style="background:{colour}">{html.escape(words)}</span>'
        for words, colour in (
            ("first step", ARM_COLOURS["first"]),
            ("warm-up / one-off", ARM_COLOURS["warm-up"]),
            ("trial: without", ARM_COLOURS["without"]),
            ("trial: with", ARM_COLOURS["with"]),
        )
    )
    marks = "".join(f"<li>step {step}: {html.escape(label)}</li>" for step, label in _marks(data))
    return f'{"".join(parts)}<p class="legend">{legend}</p><ul>{marks}</ul>'


def _duration(ms: float) -> str:
    """The axis's top in few characters (it sits in the chart's left margin), in the unit the axis
    is named in."""
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def _line(values: list, every: int, x, y, colour: str, name: str, element_id: str = "") -> str:
    # each point at the middle of the steps it stands for
    points = " ".join(f"{x((index + 0.5) * every)},{y(value * 1000)}" for index, value in enumerate(values))
    ident = f' id="{element_id}"' if element_id else ""
    return (
        f'<polyline{ident} points="{points}" fill="none" stroke="{colour}" stroke-width="1.5">'
        f"<title>{html.escape(name)}</title></polyline>"
    )


def _spans(data: dict, steps: int) -> list:
    """(first step, last step, colour, words) of each shaded span: warm-up, then each trial's arms."""
    timeline = data.get("timeline") or {}
    spans = [
        (0, data["steps"].get("warmup_steps", 0), ARM_COLOURS["warm-up"], "warm-up (not timed)"),
        (0, 1, ARM_COLOURS["first"], FIRST_STEP_FROM.get(timeline.get("first_step_from"), "first step")),
    ]
    decided = set()
    for record in data["trials"]:
        step = record.get("started_at_step", 0)
        decided.add((record["candidate"], step))
        for arm, count in record.get("arms", ()):
            spans.append((step, step + count, ARM_COLOURS[arm], f"{record['candidate']} trial: {arm}"))
            step += count
    for event in timeline.get("events", ()):
        if event["event"] == "trial_started" and (event["unit"], event["step"]) not in decided:
            spans.append((event["step"], steps, ARM_COLOURS["without"], f"{event['unit']} trial, unfinished"))
    return spans


def _marks(data: dict) -> list:
    """(step, words) of each moment marked: what units did, each trial's decision, the settling."""
    marks = [
        (event["step"], _words(event))
        for event in (data.get("timeline") or {}).get("events", ())
        if event["event"] != "trial_started"
    ]
    for record in data["trials"]:
        end = record.get("started_at_step", 0) + record["steps"]
        figure = format_speedup(record.get("speedup", record.get("ratio")), spread(record))
        marks.append((end, f"{record['candidate']}: {record['decision']} ({figure})"))
    settled = data["steps"].get("decisions_settled_at_step")
    if settled:
        marks.append((settled, "every decision made"))
    return sorted(marks)


def _words(event: dict) -> str:
    if "passes" in event:  # the step counter's, not a unit's
        return f"{event['passes']} {EVENT_WORDS[event['event']]}"
    return f"{event['unit']}: {EVENT_WORDS.get(event['event'], event['event'])}"


def unit_table(units: list) -> str:
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(cell))}</td>"
            for cell in (
                row["name"],
                row["status"],
                row["reason"],
                ", ".join(f"{k}={v}" for k, v in row["figures"].items()),
                "; ".join(row["notes"]),
            )
        )
        + "</tr>"
        for row in units
    )
    return f"<table><tr><th>unit</th><th>status</th><th>reason</th><th>figures</th><th>notes</th></tr>{rows}</table>"
