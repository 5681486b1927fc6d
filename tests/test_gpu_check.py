"""The lent-GPU battery (benchmarks/gpu_check.py): its parts fit a 10-minute command, its install
makes a checkout importable without pip, and its dry run drives every harness on the CPU."""

import importlib.util
import json
import signal
import subprocess
import sys

import pytest

from tests.helpers import REPO, ForkingRuns

CORPUS = REPO.parent / "shared" / "corpus"


def load_gpu_check():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


def test_every_part_is_listed_in_order_and_fits_a_ten_minute_command(capsys):
    gpu_check = load_gpu_check()
    assert sorted(gpu_check.ORDER) == sorted(gpu_check.PARTS)
    assert all(part.gpu_minutes < 10 for part in gpu_check.PARTS.values())
    assert gpu_check.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(f"| {part} |" in listed for part in gpu_check.ORDER)


def test_every_corpus_gpu_case_is_in_exactly_one_shard():
    if not (CORPUS / "corpus.json").exists():
        pytest.skip(f"no corpus at {CORPUS}")
    gpu_check = load_gpu_check()
    manifest = json.loads((CORPUS / "corpus.json").read_text())
    sharded = [name for names in gpu_check.CORPUS_SHARDS.values() for name in names]
    assert sorted(sharded) == sorted(case["name"] for case in manifest["cases"] if "gpu" in case["where"])


def test_a_corpus_case_started_near_the_deadline_gives_its_runs_only_the_time_left(monkeypatch, tmp_path):
    gpu_check = load_gpu_check()
    monkeypatch.setattr(gpu_check.time, "monotonic", lambda: 1000.0)
    ctx = gpu_check.Context(tmp_path, tmp_path, False, "machine", deadline=1000.0 + 200)
    assert ctx.run_limit(4) == 50  # four runs share the 200 s left
    assert ctx.run_limit(1) == gpu_check.CORPUS_TIMEOUT_S  # never more than one run's own limit
    late = gpu_check.Context(tmp_path, tmp_path, False, "machine", deadline=1000.0 - 5)
    assert late.run_limit(4) == gpu_check.CORPUS_TIMEOUT_FLOOR_S
    dry = gpu_check.Context(tmp_path, tmp_path, True, "machine", deadline=1000.0 - 5)
    assert dry.run_limit(4) == gpu_check.CORPUS_TIMEOUT_S  # a dry run has no deadline


def test_pytest_counts_read_passes_failures_and_skips_from_junit_xml(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase classname="a" name="ok"/>'
        '<testcase classname="a" name="bad"><failure message="assert 1 == 2"/></testcase>'
        '<testcase classname="a" name="gpu"><skipped message="needs CUDA"/></testcase></testsuite></testsuites>'
    )
    counts = load_gpu_check().pytest_counts(xml)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    assert counts["failures"] == [{"test": "a::bad", "message": "assert 1 == 2"}]


def test_several_parts_run_in_one_call_in_the_order_given_and_a_wrong_one_names_the_parts(
    tmp_path, monkeypatch, capsys
):
    gpu_check = load_gpu_check()
    ran = []
    monkeypatch.setattr(gpu_check, "run_part", lambda ctx, part: ran.append(part) or [])
    assert gpu_check.main(["--part", "2a,1", "--out", str(tmp_path)]) == 0
    assert ran == ["2a", "1"]
    with pytest.raises(SystemExit):
        gpu_check.main(["--part", "1,9", "--out", str(tmp_path)])
    assert "no part 9; the parts: 1, 2a, 3a" in capsys.readouterr().err


def test_install_makes_the_checkout_importable_through_a_path_file(tmp_path, monkeypatch):
    """On the lent machine autogaudi is not installed: the path files must make a bare interpreter
    (no PYTHONPATH, started elsewhere) find this checkout, as an editable install would."""
    gpu_check = load_gpu_check()
    assert importlib.util.find_spec("autogaudi") is not None  # this process finds it: not what counts
    run = subprocess.run

    def bare(command, **options):  # the lent machine's interpreter: no site-packages of ours
        return run([command[0], "-S", *command[1:]], **{**options, "env": {}})

    monkeypatch.setattr(gpu_check.subprocess, "run", bare)
    monkeypatch.setattr(gpu_check.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path)})
    said = gpu_check.install()
    assert str(REPO) in said and (tmp_path / "autogaudi.pth").exists()
    probe = f"import site; site.addsitedir({str(tmp_path)!r}); import autogaudi; print(autogaudi.__file__)"
    done = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, capture_output=True, text=True, env={})
    assert done.stdout.strip() == str(REPO / "autogaudi" / "__init__.py"), done.stderr


def test_install_leaves_an_interpreter_that_imports_autogaudi_as_it_is(tmp_path, monkeypatch):
    gpu_check = load_gpu_check()
    monkeypatch.setattr(gpu_check.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path)})
    assert gpu_check.install().startswith("autogaudi already importable from ")
    assert list(tmp_path.iterdir()) == []


def within_ten_minutes(call, *args):
    """``call(*args)``, stopped by a TimeoutError after 10 minutes: the bound the battery had as a process."""

    def over(*_):
        raise TimeoutError(f"{call.__name__} ran over 10 minutes")

    previous = signal.signal(signal.SIGALRM, over)
    signal.alarm(600)
    try:
        return call(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.slow
def test_the_dry_run_drives_every_harness_on_the_cpu(tmp_path, monkeypatch, capsys):
    """The battery's main in this process, every harness's own code as it is; the harnesses' runs
    forked where a real interpreter cannot be told apart (tests.helpers.ForkingRuns), each on one
    intra-op thread, as tests.helpers.clean_env gives, and without this process's inductor folder."""
    gpu_check = load_gpu_check()
    for harness in (gpu_check.corpus, gpu_check.suite, gpu_check.second_run):
        monkeypatch.setattr(harness, "subprocess", ForkingRuns())
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    arguments = ["--dry-run", "--out", str(tmp_path)] + (["--corpus", str(CORPUS)] if CORPUS.exists() else [])
    exit_code = within_ten_minutes(gpu_check.main, arguments)
    said = capsys.readouterr()
    assert exit_code == 0, said.out[-4000:] + said.err[-4000:]
    assert said.out.count("DRY RUN on the CPU") == len(gpu_check.ORDER)
    rows = {}
    for summary in tmp_path.glob("gpu-check-*-summary-*.json"):
        data = json.loads(summary.read_text())
        assert data["dry_run"]
        rows.update({(data["part"], r["item"]): r for r in data["rows"]})
    tests = f"pytest -m cuda {load_gpu_check().DRY_TESTS}"
    assert rows[("1", tests)]["detail"].startswith("0 passed, 0 failed, 1 skipped")  # the test needs CUDA
    for part, item in [
        ("3a", "rl_policy"),
        ("4", "w2_transformer precision"),
        ("5", "second run"),
    ]:
        assert rows[(part, item)]["status"] == "ok", rows[(part, item)]
    workloads = json.loads(next(tmp_path.glob("gpu-check-3a-workloads-*.json")).read_text())
    assert set(workloads["workloads"]["rl_policy"]) == {"plain", "autogaudi", "hand-tuned"}
    assert all(row["losses_match"] for row in workloads["workloads"]["rl_policy"].values())
