"""The benchmark suite's outputs, from a results file: the Markdown table and the PNG chart."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO


def load_run():
    spec = importlib.util.spec_from_file_location("benchmark_run", REPO / "benchmarks" / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_results(run) -> dict:
    def row(median, plain, tuned, matching=True):
        return {
            "steps_per_s": {"median": median, "min": median * 0.9, "max": median * 1.1, "rounds": 5},
            "steps_per_s_by_round": [median * 0.9, median, median, median * 1.1, median],
            "ratio_vs_plain": median / plain,
            "ratio_vs_plain_range": [0.9 * median / plain, 1.1 * median / plain],
            "ratio_vs_hand_tuned": median / tuned,
            "max_relative_loss_difference": 1e-6 if matching else 0.5,
            "losses_match": matching,
            "max_loss_difference_vs_hand_tuned": 0.0,
        }

    rates = {"plain": 100.0, "autogaudi": 120.0, "hand-tuned": 125.0, "autogaudi, all units off": 99.0}
    assert set(rates) == set(run.VARIANTS)
    ddp_rates = {**rates, **dict.fromkeys(run.EXTRA_VARIANTS["w5_ddp_2_ranks"], 110.0)}
    return {
        "machine": "test-machine",
        "torch": "2.13.0",
        "rounds": 5,
        "workloads": {
            "w1_mlp": {
                name: row(rate, 100.0, 125.0, name != "autogaudi, all units off") for name, rate in rates.items()
            },
            "w5_ddp_2_ranks": {name: row(rate, 100.0, 125.0) for name, rate in ddp_rates.items()},
        },
        "startup": {"ms": {"plain": {"median": 17.0}, "AUTOGAUDI=1": {"median": 26.0}}, "added_ms": 9.0},
    }


def test_the_table_states_ratios_and_flags_different_training():
    run = load_run()
    table = run.markdown_table(fake_results(run))
    assert "| w1_mlp | autogaudi | 120.0 (108.0-132.0) | 1.200x | 0.960x |" in table
    assert "| w1_mlp | autogaudi, all units off | 99.0" in table and "(DIFFERENT TRAINING)" in table
    assert "AUTOGAUDI=1 26.0 ms (+9.0 ms)" in table
    assert "| w5_ddp_2_ranks | autogaudi --force fast_ddp | 110.0 (99.0-121.0) | 1.100x | 0.880x |" in table


def test_ratios_are_paired_by_round_so_drift_between_rounds_cancels(monkeypatch):
    """The machine runs round 3 at a quarter of round 1's speed for plain but not for autogaudi:
    the ratio of medians (150/200) would call autogaudi slower; two of three rounds say 1.2x."""
    run = load_run()
    scripted = {"plain": [100.0, 200.0, 400.0], "autogaudi": [120.0, 240.0, 150.0]}
    variants = {name: ([name], []) for name in ("plain", "autogaudi", "hand-tuned")}
    scripted["hand-tuned"] = list(scripted["plain"])

    def fake_run(command):
        return {"steps_per_s": scripted[command[0]].pop(0), "losses": [1.0]}

    monkeypatch.setattr(run, "run_json", fake_run)
    rows = run.step_rates(["workload.py"], rounds=3, variants=variants)
    assert rows["autogaudi"]["ratio_vs_plain"] == pytest.approx(1.2)
    assert rows["autogaudi"]["ratio_vs_plain_range"] == pytest.approx([0.375, 1.2])
    assert rows["autogaudi"]["steps_per_s_by_round"] == [120.0, 240.0, 150.0]
    assert "median of the rounds' own ratios" in run.markdown_table({**fake_results(run), "workloads": {"w": rows}})


@pytest.mark.parametrize(("plain_again", "matches"), [([1.0, 2.0], False), ([1.0, 3.5], True)])
def test_a_variant_within_plains_own_round_to_round_difference_trains_like_plain(monkeypatch, plain_again, matches):
    """A seeded run that does not repeat itself (a GPU's atomics, an RL trajectory parting ways): plain's
    second round moved 75% from its first, so autogaudi's 50% is plain's; with plain steady it is not."""
    run = load_run()
    scripted = {"plain": [[1.0, 2.0], plain_again], "autogaudi": [[1.0, 3.0]] * 2, "hand-tuned": [[1.0, 2.0]] * 2}
    variants = {name: ([name], []) for name in scripted}
    monkeypatch.setattr(run, "run_json", lambda command: {"steps_per_s": 1.0, "losses": scripted[command[0]].pop(0)})
    rows = run.step_rates(["workload.py"], rounds=2, variants=variants)
    assert rows["autogaudi"]["max_relative_loss_difference"] == pytest.approx(0.5)
    assert rows["autogaudi"]["plain_own_loss_difference"] == pytest.approx(0.75 if matches else 0.0)
    assert rows["autogaudi"]["losses_match"] is matches
    line = run.table_row("w", "autogaudi", rows["autogaudi"])
    assert ("within plain's own round-to-round" in line) is matches and ("DIFFERENT TRAINING" in line) is not matches


def test_render_writes_the_table_and_a_png_chart_beside_the_results(tmp_path):
    pytest.importorskip("matplotlib")
    run = load_run()
    results = tmp_path / "machine.json"
    results.write_text(json.dumps(fake_results(run)))
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--render", str(results)], check=True, capture_output=True
    )
    table, chart = run.companions(results)
    assert table.read_text() == run.markdown_table(fake_results(run))
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and chart.stat().st_size > 5000


def test_the_control_variant_runs_the_plain_command_again_in_every_round(monkeypatch):
    """--control's A/A row is only a noise floor if it is exactly plain PyTorch, run in the same rounds."""
    run = load_run()
    commands = []

    def fake_run(command):
        commands.append(command)
        return {"steps_per_s": 100.0, "losses": [1.0]}

    monkeypatch.setattr(run, "run_json", fake_run)
    rows = run.step_rates(["workload.py"], rounds=2, variants={**run.VARIANTS, **run.CONTROL_VARIANT})
    control = next(iter(run.CONTROL_VARIANT))
    assert len(commands) == 2 * len(rows) and commands.count(["workload.py"]) == 4  # plain and control, twice
    assert rows[control]["ratio_vs_plain"] == 1.0 and rows[control]["losses_match"]


def test_autogaudi_variants_report_their_trial_decisions_and_the_table_shows_them(tmp_path):
    run = load_run()
    command, read = run.trial_decisions(["-m", "autogaudi", "--quiet"], ["w.py"], ["--steps", "3"])
    assert command[:3] == ["-m", "autogaudi", "--report"] and command[4:] == ["--quiet", "w.py", "--steps", "3"]
    report = {"trials": [{"candidate": "graph_capture", "decision": "rejected"}]}
    Path(command[3]).write_text(json.dumps(report))
    assert read() == ["graph_capture rejected"] and not Path(command[3]).exists()
    plain_command, plain_read = run.trial_decisions([], ["w.py"], [])
    assert plain_command == ["w.py"] and plain_read() is None
    results = fake_results(run)
    results["workloads"]["w1_mlp"]["autogaudi"]["trial_decisions_by_round"] = [["graph_capture rejected"], []]
    assert "(trials: graph_capture rejected in 1/2)" in run.markdown_table(results)


@pytest.mark.skipif(
    not (REPO.parent / "shared" / "corpus" / "corpus.json").exists(), reason="no shared corpus beside the repository"
)
def test_the_second_run_benchmark_runs_the_corpus_gpt_under_the_forced_variant(monkeypatch, tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("benchmark_second_run", REPO / "benchmarks" / "second_run.py")
    second_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(second_run)
    pairs = []
    monkeypatch.setattr(second_run, "pair", lambda name, command, cwd, env, scratch: pairs.append((name, command)))
    monkeypatch.setattr(second_run.subprocess, "run", lambda *args, **kwargs: None)
    second_run.gpt_capture_forced({}, tmp_path, REPO.parent / "shared" / "corpus", second_run.SHORT)
    ((name, command),) = pairs
    assert name == "gpt" and command[:5] == ["-m", "autogaudi", "--force", "graph_capture,channels_last", "--no-trials"]
    assert "projects/chargpt/chargpt.py" in command


def load_benchmark(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_start_up_budget_is_judged_on_the_pairs_median_unless_their_spread_hides_it():
    startup = load_benchmark("startup")

    def figures(median, low, high):
        return {"wall_ms": {"added": {"median": median, "min": low, "max": high}}}

    assert startup.verdict(figures(20.0, 10.0, 30.0)) == "within"
    assert startup.verdict(figures(40.0, 30.0, 50.0)) == "over"
    assert startup.verdict(figures(40.0, -900.0, 900.0)) == "unresolved"  # a busy machine's pairs


def test_counted_instructions_judge_the_start_up_budget_where_the_pairs_cannot(tmp_path):
    """Counted, the verdict is the instructions' milliseconds at plain's rate in each phase, even
    where the pairs' wall times read otherwise."""
    startup = load_benchmark("startup")
    plain = dict.fromkeys(startup.PHASES, 1_000_000)
    ours = {**plain, "before_torch": 3_000_000, "step": 1_500_000}
    plain_cpu_ms = dict.fromkeys(startup.PHASES, 10.0)  # 10 ms per million instructions in every phase
    counted = startup.instructions_added({"autogaudi": ours, "plain": plain}, plain_cpu_ms)
    assert counted["added"] == {
        **dict.fromkeys(startup.PHASES, 0),
        "before_torch": 2_000_000,
        "step": 500_000,
        "all": 2_500_000,
    }
    assert counted["added_ms_at_plain_rate"]["all"] == pytest.approx(25.0)
    wall_within = {"added": {"median": 0.0, "min": -5.0, "max": 5.0}}
    assert startup.verdict({"wall_ms": wall_within, "instructions": counted}) == "within"
    counted["added_ms_at_plain_rate"]["all"] = 25.1
    assert startup.verdict({"wall_ms": wall_within, "instructions": counted}) == "over"
    # the collector's own instructions taken out: a collection moved into the step is not the start's work
    collector = {
        "autogaudi": {**dict.fromkeys(startup.PHASES, 0), "step": 400_000},
        "plain": dict.fromkeys(startup.PHASES, 0),
    }
    counted = startup.instructions_added({"autogaudi": ours, "plain": plain, "collector": collector}, plain_cpu_ms)
    assert counted["added_outside_collector"] == {**counted["added"], "step": 100_000, "all": 2_100_000}


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_callgrind_counts_each_marked_phase_and_refuses_a_mark_too_many(tmp_path):
    startup = load_benchmark("startup")
    marked = "import gc, os; gc.disable(); os.getpgrp(); sum(range({})); os.getpgrp(); gc.collect(); os.getpgrp()"
    out = tmp_path / "run.callgrind"
    process = startup.counted([sys.executable, "-c", marked.format(10**6)], dict(os.environ), out)
    assert process.wait() == 0, process.stderr.read()
    phases = startup.phase_instructions(out)
    assert tuple(phases) == startup.PHASES
    assert phases["torch_import"] > 10 * phases["step"]  # the loop's million additions, between the first marks
    collected = startup.phase_collector_instructions(out)
    assert collected["step"] > 0 and collected["torch_import"] == 0  # the collection runs in the third phase only
    process = startup.counted([sys.executable, "-c", marked.format(1) + "; os.getpgrp()"], dict(os.environ), out)
    assert process.wait() == 0
    with pytest.raises(RuntimeError):
        startup.phase_instructions(out)


def test_the_start_up_pairs_are_split_by_phase_from_the_cpu_times_the_script_marks(tmp_path):
    """The phases come from the script's own marks and the process's CPU at its end: they add up to
    the run's CPU, and the added figures count the pairs where autogaudi's phase took more."""
    startup = load_benchmark("startup")
    marks = tmp_path / "marks"
    script = f"open({str(marks)!r}, 'w').write('0.010 0.030 0.045')"
    _wall, cpu, phases = startup.timed([sys.executable, "-c", script], {**os.environ, "STARTUP_MARKS": str(marks)})
    assert tuple(phases) == startup.PHASES
    assert [round(phases[name], 6) for name in startup.PHASES[:3]] == [10.0, 20.0, 15.0]
    assert sum(phases.values()) == pytest.approx(cpu)

    def run(before_torch):
        return (0.0, 0.0, dict.fromkeys(startup.PHASES, 5.0) | {"before_torch": before_torch})

    added = startup.phases_added([run(30.0), run(26.0), run(19.0)], [run(20.0), run(20.0), run(20.0)])
    assert added["before_torch"] == {"median": 6.0, "min": -1.0, "max": 10.0, "more_in": 2, "pairs": 3}
    assert added["step"]["more_in"] == 0


def test_a_reports_claim_agrees_only_within_what_the_pairs_measured():
    against_plain = load_benchmark("against_plain")

    def claim(slower_s, noise_s=None, stated=True):
        return {"slower_s": slower_s, "noise_s": noise_s, "stated": stated}

    measured = [0.4, 0.5, 0.6]
    assert against_plain.judge(measured, [claim(0.45), claim(0.5), claim(None)])["agrees"] is True
    judged = against_plain.judge(measured, [claim(0.45), claim(0.01)])  # the cost nothing counted
    assert judged["agrees"] is False and judged["claims_within"] == [True, False]
    assert against_plain.judge(measured, [claim(0.01, noise_s=0.5)])["agrees"] is True  # within its noise
    assert against_plain.judge(measured, [claim(-3.0, noise_s=4.0, stated=False)])["agrees"] is True
    assert against_plain.judge([0.4, 0.5], [claim(None)])["agrees"] is None
    report = {"summary": {"whole_run": {"net_s": -0.3, "noise_s": 0.1, "claimed": True}}}
    assert against_plain.claim_of(report) == claim(0.3, noise_s=0.1)


def test_a_difference_is_resolved_only_outside_what_plain_against_plain_moved():
    against_plain = load_benchmark("against_plain")
    assert against_plain.resolved([0.3, 0.4, 0.5], [-0.2, 0.1, 0.2]) is True
    assert against_plain.resolved([0.1, 0.15, 0.5], [-0.2, 0.1, 0.2]) is False


def test_the_control_runs_plains_command_again_in_a_rotating_order(monkeypatch, tmp_path):
    """--control's A/A pairs are a noise floor only if the third run is exactly plain, each arm in
    each position in turn."""
    against_plain = load_benchmark("against_plain")
    ran = []

    def fake_run(command, env, folder, timeout, result):
        ran.append("autogaudi" if "autogaudi" in command else "plain")
        if "--report" in command:
            report = {"summary": {"whole_run": {"net_s": -0.1, "noise_s": None, "claimed": True}}}
            Path(command[command.index("--report") + 1]).write_text(json.dumps(report))
        return (2.0 if ran[-1] == "autogaudi" else 1.0), 1.0, "loss 1"

    monkeypatch.setattr(against_plain, "timed_run", fake_run)
    monkeypatch.setattr(against_plain.corpus, "run_setup", lambda case, folder: None)
    (tmp_path / "case").mkdir()
    case = {"name": "c", "corpus": tmp_path / "case", "dir": ".", "command": ["train.py"], "result": "loss"}
    result = against_plain.measure_case(case, pairs=3, scratch=tmp_path / "scratch", timeout=9.0, control=True)
    assert [ran[i : i + 3] for i in range(0, 12, 3)] == [
        ["plain", "autogaudi", "plain"],
        ["autogaudi", "plain", "plain"],
        ["plain", "plain", "autogaudi"],
        ["plain", "autogaudi", "plain"],
    ]
    assert result["control_differences_s"] == [0.0, 0.0, 0.0] and result["differences_s"] == [1.0, 1.0, 1.0]
    assert result["resolved"] is True and result["agrees"] is False  # it claimed 0.1 s where the pairs read 1 s
    assert result["ratio_plain_over_autogaudi"] == 0.5 and result["ratio_plain_over_plain_again"] == 1.0


def test_the_quick_starts_claims_are_judged_against_the_spread_of_their_rounds_pairs():
    """A claim meets the pairs' range with its noise, or states no figure (within noise): either is within."""
    quickstart = load_benchmark("quickstart")
    runs = {
        "plain": [{"seconds": 10.0}, {"seconds": 12.0}, {"seconds": 11.0}],
        "autogaudi": [
            {"seconds": 8.0, "claimed_against_plain_s": 2.5, "claim_noise_s": None, "claim_stated": True},
            {"seconds": 9.0, "claimed_against_plain_s": 6.0, "claim_noise_s": 1.0, "claim_stated": True},
            {"seconds": 9.0, "claimed_against_plain_s": 6.0, "claim_noise_s": 4.0, "claim_stated": False},
        ],
    }
    judged = quickstart.claims_against_pairs(runs)
    assert judged["pairs_s"] == [2.0, 3.0, 2.0]
    assert judged["within"] == [True, False, True]


@pytest.mark.slow
def test_the_phases_probe_splits_plain_and_autogaudi_runs_and_reads_the_reports_cost(tmp_path):
    script = tmp_path / "steps.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(4, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    model(torch.randn(2, 4)).sum().backward()\n"
        "    optimizer.step()\n"
    )
    done = subprocess.run(
        [sys.executable, REPO / "benchmarks" / "phases.py", "--pairs", "1", "--cwd", tmp_path, script],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    names = [line.split()[0] for line in done.stdout.splitlines()]
    assert names == [
        "start_cpu_s",
        "loop_wall_s",
        "loop_cpu_s",
        "exit_cpu_s",
        "teardown_cpu_s",
        "total_cpu_s",
        "wall_s",
        "reported",
    ]
