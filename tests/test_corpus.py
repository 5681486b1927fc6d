"""The corpus harness: its verdicts on made-up runs, and the corpus's CPU cases in CI, run plain,
under autogaudi and with capture forced, with no crash, no exit-code difference and every
checkpoint written and loadable with plain torch."""

import importlib.util
import json
import subprocess

import pytest

from tests.helpers import REPO, ForkingRuns

CORPUS = REPO.parent / "shared" / "corpus"


def load_corpus(forking=False):
    """benchmarks/corpus.py, a module of its own; ``forking``: its runs go through :class:`ForkingRuns`."""
    spec = importlib.util.spec_from_file_location("benchmark_corpus", REPO / "benchmarks" / "corpus.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if forking:
        module.subprocess = ForkingRuns()
    return module


def run(exit_code=0, seconds=10.0, result="loss 1.000", files=("model.pt",), checkpoints=None):
    return {
        "exit_code": exit_code,
        "seconds": seconds,
        "result": result,
        "files": list(files),
        "checkpoints": {"model.pt": {"kind": "OrderedDict", "tensors": {"w": ["torch.float32", [2]]}}}
        if checkpoints is None
        else checkpoints,
    }


CASE = {"name": "a-case", "result": "loss [0-9.]+"}


def test_a_unit_that_failed_inside_a_run_is_a_crash_though_the_run_went_on_as_plain():
    failed = {"name": "fused_optimizer", "status": "failed", "reason": "raised TypeError(...)"}
    mine = {**run(), "report": {"units": [failed, {"name": "step_profiler", "status": "watching", "reason": ""}]}}
    found = load_corpus().verdict(CASE, "autogaudi", run(), mine)
    assert found["verdict"] == "crashed" and "fused_optimizer" in found["why"][0]
    assert load_corpus().verdict(CASE, "autogaudi", run(), {**mine, "report": {"units": []}})["verdict"] == "same"


def test_timings_in_a_result_line_are_not_compared():
    corpus = load_corpus()
    assert corpus.result_numbers("iter_dt 12.69ms; iter 90: train loss 2.61085") == [90.0, 2.61085]
    same, _ = corpus.compare_results(
        CASE, "autogaudi", "iter_dt 12.7ms; iter 90: train loss 2.6108", "iter_dt 5.4ms; iter 90: train loss 2.6110"
    )
    assert same


@pytest.mark.parametrize(
    "mine, expected",
    [
        (run(), "same"),
        (run(seconds=12.0), "slower"),
        (run(result="loss 1.200"), "differs"),
        (run(exit_code=1), "crashed"),
        (run(files=()), "differs"),
        (run(exit_code=1, files=()), "crashed"),
        (run(checkpoints={"model.pt": {"error": "UnpicklingError: object proxy"}}), "crashed"),
        (run(checkpoints={"model.pt": {"kind": "OrderedDict", "tensors": {"w": ["torch.bfloat16", [2]]}}}), "differs"),
    ],
)
def test_verdicts_against_plain(mine, expected):
    assert load_corpus().verdict(CASE, "autogaudi", run(), mine)["verdict"] == expected


def with_sums(**sums):
    return {"model.pt": {"kind": "OrderedDict", "tensors": {"w": ["torch.float32", [2]]}, "sums": sums}}


@pytest.mark.parametrize(
    "mine, expected",
    [
        (with_sums(w=[1.02, 3.0]), "same"),  # 0.02 off, within 5% of the 3.0 the values add up to in size
        (with_sums(w=[1.5, 3.0]), "differs"),
        (with_sums(w=[float("nan"), float("nan")]), "differs"),  # diverged where plain did not
    ],
)
def test_checkpoint_values_are_compared_by_their_sums(mine, expected):
    """A script that prints no result (FSDP2's example) is checked by what it saved."""
    plain = run(checkpoints=with_sums(w=[1.0, 3.0]))
    assert load_corpus().verdict(CASE, "autogaudi", plain, run(checkpoints=mine))["verdict"] == expected


def test_a_checkpoint_folder_named_by_the_time_is_compared_by_kind():
    normalised = load_corpus().normalised
    assert normalised("fsdp2/checkpoints/dtensor_api/1795487708169/model_state_dict.pt") == normalised(
        "fsdp2/checkpoints/dtensor_api/1795487734985/model_state_dict.pt"
    )
    assert normalised("runs/2/model.pt") == "runs/2/model.pt"


def test_the_distributed_cases_come_from_their_own_manifest_and_run_under_torchrun():
    corpus = load_corpus()
    cases = corpus.load_cases([corpus.DIST_CORPUS], "cpu", None)
    assert {case["name"] for case in cases} >= {"fsdp2", "fsdp2-dcp-resume", "ddp"}
    for case in cases:
        assert case["corpus"] == corpus.DIST_CORPUS
        assert case["command"][:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
        assert (corpus.DIST_CORPUS / case["dir"] / "SOURCE.md").exists()


def test_forced_capture_is_compared_more_loosely_and_unseeded_cases_not_at_all():
    corpus = load_corpus()
    assert corpus.verdict(CASE, "capture forced", run(), run(result="loss 1.200"))["verdict"] == "same"
    unseeded = {"name": "regression", "result": CASE["result"]}
    assert corpus.verdict(unseeded, "autogaudi", run(), run(result="loss 9.0"))["verdict"] == "same"


def on_the_double(device, migration="mapped", held=None) -> dict:
    """A run under the double whose report places the model on ``device``, its optimizers holding
    ``held`` parameters by device at exit."""
    units = [{"name": "gpu_migration", "reason_code": migration}]
    report = {"backend": {"name": "hpu", "placement": {"device": device, "on_device": device == "hpu"}}, "units": units}
    facts = {"optimizer_parameters": held if held is not None else {device: 4}}
    return {**run(), "report": report, "double": facts}


def test_on_the_double_a_cuda_case_left_on_the_host_differs_and_a_cpu_written_one_may_stay_there():
    corpus = load_corpus()
    for variant in ("hpu double latest", "hpu double 1.19"):
        assert corpus.verdict(CASE, variant, run(), on_the_double("hpu"))["verdict"] == "same"
        assert corpus.verdict(CASE, variant, run(), on_the_double("cpu"))["verdict"] == "differs"
        assert corpus.verdict(CASE, variant, run(), on_the_double("cpu", "script_not_cuda"))["verdict"] == "same"
        # placed on hpu at first, but a parameter the optimizer holds at exit is on the host
        held = {"hpu": 3, "cpu": 1}
        assert corpus.verdict(CASE, variant, run(), on_the_double("hpu", held=held))["verdict"] == "differs"
    # only these variants run with the double on the path, under the release each names
    for variant, release in (("hpu double latest", "latest"), ("hpu double 1.19", "1.19")):
        env = corpus.clean_env({}, variant)
        assert env["PYTHONPATH"].split(":")[0] == str(corpus.HPU_DOUBLE)
        assert env["HPU_DOUBLE_RELEASE"] == release
    assert "HPU_DOUBLE_RELEASE" not in corpus.clean_env({}, "autogaudi")


def test_the_eager_releases_second_run_must_compile_nothing():
    corpus = load_corpus()
    again = on_the_double("hpu")

    def metrics(compiled, hits, misses):
        graphs = {"TotalNumber": compiled, "TotalTime": 0, "AvgTime": 0}
        return {"graph_compilation": graphs, "recipe_cache": {"TotalHit": hits, "TotalMiss": misses}}

    for variant in ("hpu double latest again", "hpu double latest capture forced again"):
        again["double"]["metrics"] = metrics(0, 3, 0)
        assert corpus.verdict(CASE, variant, run(), again)["verdict"] == "same"
        again["double"]["metrics"] = metrics(2, 1, 2)
        assert corpus.verdict(CASE, variant, run(), again)["verdict"] == "differs"
        again["double"]["metrics"] = metrics(0, 0, 0)  # nothing compiled in either run: no cache at work
        assert corpus.verdict(CASE, variant, run(), again)["verdict"] == "differs"
        del again["double"]["metrics"]  # the bridge never loaded: nothing says what was compiled
        assert corpus.verdict(CASE, variant, run(), again)["verdict"] == "differs"
        assert corpus.clean_env({}, variant)["HPU_DOUBLE_RELEASE"] == "latest"
    # the double's device is the machine's CPU: its results are named by both
    assert corpus.default_name(["plain", "hpu double 1.19"]) == f"corpus-hpu-double-1.19-{corpus.machine_name()}.json"


def run_corpus(tmp_path, *args):
    """benchmarks/corpus.py's main with ``args`` in this process, its runs through :class:`ForkingRuns`
    and its scratch and results in ``tmp_path``: (its exit code, the results)."""
    out = tmp_path / "corpus.json"
    exit_code = load_corpus(forking=True).main([*args, "--out", str(out), "--scratch", str(tmp_path / "runs")])
    return exit_code, json.loads(out.read_text())


# The case forced capture runs on in the suite (a GPT, captured by region): a cold compile, about
# 40 s here; makemore-gru's unrolled loop took 55 s more. The full corpus run forces it on every case.
FORCED = ("mingpt-adder",)
# --exact is left out where another case runs the same script and model under it: minGPT's adder with
# DataLoader workers is mingpt-adder's command but for its workers, which the default variant runs.
NOT_EXACT = ("mingpt-adder-workers",)


def test_repeats_time_plain_and_autogaudi_in_alternating_rounds_by_their_median(monkeypatch):
    corpus = load_corpus()
    order = []
    times = {"plain": iter([9.0, 11.0]), "autogaudi": iter([30.0, 10.5]), "exact": iter([])}

    def run_variant(case, variant, scratch, timeout):
        order.append(variant)
        exit_code = 1 if variant == "autogaudi" and len(order) > 2 else 0
        return {**run(seconds=next(times[variant]), exit_code=exit_code), "output_tail": ""}

    monkeypatch.setattr(corpus, "run_variant", run_variant)
    runs = {"plain": run(seconds=10.0), "autogaudi": run(seconds=10.2), "exact": run(seconds=40.0)}
    corpus.repeat_timed(CASE, runs, None, 60, repeat=3)
    assert order == ["plain", "autogaudi", "autogaudi", "plain"]  # the exact variant ran once
    assert runs["plain"]["seconds_runs"] == [10.0, 9.0, 11.0] and runs["plain"]["seconds"] == 10.0
    assert runs["autogaudi"]["seconds"] == 10.5 and runs["exact"]["seconds"] == 40.0
    # A repeat that exited otherwise than plain is a crash, whatever the first run did.
    assert corpus.verdict(CASE, "autogaudi", runs["plain"], runs["autogaudi"])["verdict"] == "crashed"


def cpu_cases() -> list:
    """The shared corpus's CPU cases, shortened as the suite runs them (none without the corpus)."""
    if not (CORPUS / "corpus.json").exists():
        return []
    corpus = load_corpus()
    return [corpus.shortened(case) for case in corpus.load_cases([CORPUS], "cpu", None)]


CPU_CASES = cpu_cases()
NO_CORPUS = f"no corpus at {CORPUS}: it comes with the project's shared folder, beside the repository"


@pytest.mark.skipif(not CPU_CASES, reason=NO_CORPUS)
def test_the_cpu_cases_include_a_plain_loop_and_the_cases_capture_is_forced_on():
    assert {case["name"] for case in CPU_CASES} >= {"regression", *FORCED, *NOT_EXACT}


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    CPU_CASES or [pytest.param(None, marks=pytest.mark.skip(reason=NO_CORPUS))],
    ids=lambda case: case["name"] if case else "no-corpus",
)
def test_a_cpu_case_runs_plain_under_autogaudi_exact_and_capture_forced_alike(case, tmp_path, monkeypatch):
    """A CPU case plain, under autogaudi and --exact, and capture forced where it is in ``FORCED``,
    through the harness's own run_case: one plain run serves every variant. A test per case, so a
    failure names its case. Every run, plain's too, on one intra-op thread, as torchrun
    gives each rank: with two, a loaded 2-core machine ran minGPT's 40 short steps in 112 s
    (seconds alone); the full corpus run keeps the machine's count."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # an earlier in-process compile's (helpers)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    corpus = load_corpus(forking=True)
    exact = [] if case["name"] in NOT_EXACT else ["exact"]
    variants = ["plain", "autogaudi", *exact, *(["capture forced"] if case["name"] in FORCED else [])]
    row = corpus.run_case(case, variants, tmp_path, corpus.log, 600)
    assert "skipped" not in row, row  # the test extra installs what the cases need
    plain = row["runs"]["plain"]
    assert plain["exit_code"] == 0, plain["output_tail"]
    for variant in variants[1:]:
        mine = row["runs"][variant]
        where = f"{row['name']} / {variant}: {mine['why']}\n{mine['output_tail'][-2000:]}"
        assert mine["verdict"] != "crashed", where
        assert mine["files"] == plain["files"], where
        # every checkpoint plain wrote was loaded by plain torch from this variant's run too
        assert set(mine["checkpoints"]) == set(plain["checkpoints"]), where
        assert all("error" not in summary for summary in mine["checkpoints"].values()), where
    # --exact: the result line and every checkpoint value exactly plain's (tolerance 0)
    for variant in ("autogaudi", *exact):
        assert row["runs"][variant]["verdict"] in ("same", "slower"), row["runs"][variant]["why"]
    if case["name"].startswith("mingpt"):
        assert plain["checkpoints"]  # minGPT's cases save model.pt: the loadability check really ran


@pytest.mark.slow
def test_the_fsdp2_example_runs_on_two_ranks_plain_and_under_autogaudi(tmp_path, monkeypatch):
    """pytorch/examples' FSDP2 example, unmodified, under torchrun on two gloo ranks: it crashed in
    its first census backward under autogaudi's defaults. The other variants, the DCP resume and the
    DDP case are left to the full corpus run (about 3 minutes more here). One intra-op thread, as
    torchrun gives each rank, and no inherited inductor folder: the CPU cases' fork server serves it."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    corpus = ("--corpus", str(load_corpus().DIST_CORPUS), "--cases", "fsdp2", "--variants", "plain,autogaudi")
    exit_code, results = run_corpus(tmp_path, *corpus, "--timeout", "450")
    rows = {row["name"]: row for row in results["cases"]}
    assert sorted(rows) == ["fsdp2"]
    for row in rows.values():
        assert row["runs"]["plain"]["exit_code"] == 0, row["runs"]["plain"]["output_tail"]
        assert row["runs"]["plain"]["checkpoints"], row["runs"]["plain"]["files"]
        for variant in ("autogaudi",):
            mine = row["runs"][variant]
            where = f"{row['name']} / {variant}: {mine['why']}\n{mine['output_tail'][-2000:]}"
            assert mine["verdict"] in ("same", "slower"), where
            assert mine["files"] == row["runs"]["plain"]["files"], where
            ranks = mine["report"]["ranks"]
            assert sorted(ranks) == ["0", "1"], where
            assert not [unit for rank in ranks.values() for unit in rank if unit["status"] == "failed"], where
    assert exit_code == 0


def test_a_set_up_that_ends_in_gloos_teardown_abort_runs_again_and_other_failures_raise(monkeypatch, tmp_path):
    corpus = load_corpus()
    outcomes = iter([(1, corpus.GLOO_TEARDOWN_ABORT), (0, ""), (1, "Traceback: a real error")])
    calls = []

    def run(command, **kwargs):
        calls.append(command)
        code, stderr = next(outcomes)
        return subprocess.CompletedProcess(command, code, "", stderr)

    monkeypatch.setattr(corpus.subprocess, "run", run)
    case = {"name": "a-case", "setup": [["setup.py"]]}
    corpus.run_setup(case, tmp_path)
    assert len(calls) == 2
    with pytest.raises(subprocess.CalledProcessError):
        corpus.run_setup(case, tmp_path)
    assert len(calls) == 3


def short_adder_case() -> dict:
    """minGPT's adder shortened to 10 iterations, its result the loss of the last."""
    case = next(case for case in CPU_CASES if case["name"] == "mingpt-adder")
    return {
        **case,
        "command": [arg.replace("max_iters=40", "max_iters=11") for arg in case["command"]],
        "result": r"iter 10: train loss [0-9.]+",
    }


@pytest.fixture(scope="module")
def short_adder_plain(tmp_path_factory):
    """The shortened adder's plain run, once for the tests that run it on the double."""
    corpus = load_corpus(forking=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # a plain run: the CPU cases' fork server
        patch.setenv("OMP_NUM_THREADS", "1")
        row = corpus.run_case(short_adder_case(), ["plain"], tmp_path_factory.mktemp("plain"), corpus.log, 600)
    return row


def short_adder_against_plain(plain_row, variants, scratch, timeout) -> dict:
    """The shortened adder's ``variants``, each with its verdict against the shared plain run."""
    corpus, case = load_corpus(forking=True), short_adder_case()
    plain = plain_row["runs"]["plain"]
    assert plain["result"] is not None, plain["output_tail"]
    runs = corpus.run_case(case, variants, scratch, corpus.log, timeout)["runs"]
    for variant, mine in runs.items():
        mine.update(corpus.verdict(case, variant, plain, mine))
    return runs


@pytest.mark.slow
@pytest.mark.skipif(not CPU_CASES, reason=NO_CORPUS)
def test_a_cuda_written_case_trains_on_the_doubles_hpu_under_each_release_with_plains_losses(
    tmp_path, monkeypatch, short_adder_plain
):
    """minGPT's adder (``'cuda' if torch.cuda.is_available()`` in its package) under the defaults with
    the HPU double, once per release it models: migrated, every parameter its optimizer holds on hpu,
    its loss plain's on the CPU within tolerance. Its run shortened further: 10 iterations."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runs = short_adder_against_plain(short_adder_plain, ["hpu double latest", "hpu double 1.19"], tmp_path, 600)
    for variant, lazy in (("hpu double latest", False), ("hpu double 1.19", True)):
        mine = runs[variant]
        assert mine["verdict"] in ("same", "slower"), (variant, mine["why"], mine["output_tail"][-2000:])
        backend = mine["report"]["backend"]
        assert backend["lazy"] is lazy
        assert backend["placement"]["on_device"] is True and backend["placement"]["device"] == "hpu"
        assert backend["migration"] == {**backend["migration"], "asked_for": "cuda", "ran_on": "hpu"}
        assert mine["double"]["release"] == variant.split()[-1]
        held = mine["double"]["optimizer_parameters"]
        assert set(held) == {"hpu"} and held["hpu"] > 0, held


@pytest.mark.slow
@pytest.mark.skipif(not CPU_CASES, reason=NO_CORPUS)
def test_the_eager_releases_second_run_of_a_case_on_hpu_finds_every_graph_in_the_recipe_cache(
    tmp_path, monkeypatch, short_adder_plain
):
    """minGPT's adder on the double's hpu (latest), its blocks compiled with hpu_backend (capture
    forced: a short run ends before the trial), then again in the first run's cache folder: the
    second process compiles nothing and hits the recipe cache, its loss the first's."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    first, again = "hpu double latest capture forced", "hpu double latest capture forced again"
    runs = short_adder_against_plain(short_adder_plain, [first, again], tmp_path, 900)
    compiled = runs[first]["double"]["metrics"]
    assert compiled["graph_compilation"]["TotalNumber"] > 0, runs[first]["output_tail"][-2000:]
    assert compiled["recipe_cache"]["TotalHit"] == 0
    mine = runs[again]
    assert mine["double"]["metrics"]["graph_compilation"]["TotalNumber"] == 0
    assert mine["double"]["metrics"]["recipe_cache"]["TotalHit"] > 0
    assert mine["verdict"] in ("same", "slower"), (mine["why"], mine["output_tail"][-2000:])
    assert mine["result"] == runs[first]["result"]
