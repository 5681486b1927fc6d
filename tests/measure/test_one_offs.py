"""The capture one-off's estimate: sized by the model, scaled by what this machine measured, pulled
towards the backend's prior, kept per machine in the cache; graph_capture's pay-back rule reads it."""

import json
import math
import os
import pathlib
import pwd
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from autogaudi.backends.cpu import CpuBackend
from autogaudi.measure import one_offs
from autogaudi.optimizations.graph_capture import unit as graph_capture
from autogaudi.store.cache import Cache
from tests.helpers import CORRUPTIONS, corrupt


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(8, 8)

    def forward(self, inputs):
        return torch.relu(self.mix(inputs))


class Tower(nn.Module):
    """An embedding, four repeats of one block, a head: a GPT's shape in miniature."""

    def __init__(self, blocks=4):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))
        self.head = nn.Linear(8, 2)


def cpu():
    return CpuBackend("test")


def test_repeated_blocks_finds_the_blocks_and_their_share_of_the_parameters():
    name, cls, blocks, share = one_offs.repeated_blocks(Tower())
    assert (name, cls, len(blocks)) == ("blocks", Block, 4)
    assert share == pytest.approx(4 * 72 / (72 + 4 * 72 + 18))
    assert one_offs.repeated_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) is None  # mixed classes


def test_a_bigger_graph_is_estimated_dearer_and_regional_cheaper_than_whole():
    small = one_offs.traits(nn.Linear(2, 2), 30)
    large = one_offs.traits(Tower(), 900)
    assert one_offs.estimate(large, [], cpu())["seconds"] > one_offs.estimate(small, [], cpu())["seconds"]
    whole = one_offs.estimate(large, [], cpu())
    regional = one_offs.estimate(large, [], cpu(), tier="regional")
    assert regional["seconds"] < whole["seconds"] and regional["tier"] == "regional"
    assert whole["seconds"] == pytest.approx(CpuBackend.capture_one_off_rate_s * 30)  # sqrt(900)
    assert whole["measured"] == 0 and whole["low_s"] < whole["seconds"] < whole["high_s"]


def test_the_estimate_never_goes_below_the_backends_least_one_off():
    tiny = one_offs.traits(nn.Linear(2, 2), 1)
    assert one_offs.estimate(tiny, [], cpu())["seconds"] == CpuBackend.least_capture_one_off_s


def test_measured_one_offs_move_the_rate_towards_this_machine_and_narrow_the_range():
    traits = one_offs.traits(nn.Linear(2, 2), 400)  # size 20
    prior = one_offs.estimate(traits, [], cpu())
    slow = [{"size": 20.0, "actual_s": 60.0, "warm": False}] * 8  # this machine: 3 s per unit
    learned = one_offs.estimate(traits, slow, cpu())
    assert prior["seconds"] < learned["seconds"] < 60.0  # pulled towards, not all the way (the prior's weight)
    assert learned["measured"] == 8
    assert learned["high_s"] / learned["seconds"] < prior["high_s"] / prior["seconds"]  # agreeing measurements
    expected = math.exp((2 * math.log(0.8) + 8 * math.log(3.0)) / 10) * 20
    assert learned["seconds"] == pytest.approx(expected, rel=1e-3)


def test_a_warm_compile_cache_has_a_rate_of_its_own():
    traits = one_offs.traits(nn.Linear(2, 2), 400)
    cold_only = [{"size": 20.0, "actual_s": 60.0, "warm": False}] * 4
    warm = one_offs.estimate(traits, cold_only, cpu(), warm=True)
    assert warm["measured"] == 0 and warm["warm"]  # cold measurements say nothing of a warm compile
    assert warm["seconds"] < one_offs.estimate(traits, [], cpu())["seconds"]


def test_records_are_kept_per_machine_newest_last_and_bounded(tmp_path):
    cache = Cache(str(tmp_path), 1 << 30)
    predicted = one_offs.estimate(one_offs.traits(nn.Linear(2, 2), 100), [], cpu())
    for actual in range(one_offs.KEPT + 3):
        assert one_offs.remember(cache, cpu(), one_offs.record_of(predicted, float(actual + 1)))
    records = one_offs.remembered(cache, cpu())
    assert len(records) == one_offs.KEPT and records[-1]["actual_s"] == one_offs.KEPT + 3
    assert records[-1]["predicted_s"] == predicted["seconds"] and records[-1]["size"] == predicted["size"]
    assert one_offs.remembered(None, cpu()) == [] and not one_offs.remember(None, cpu(), {})


def test_an_unwritable_cache_loses_the_record_not_the_run(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    cache = Cache(str(blocker), 1 << 30)  # its folders cannot be made under a file
    assert not one_offs.remember(cache, cpu(), {"size": 1.0, "actual_s": 1.0})


class Profile:
    def __init__(self, model, ops, ms_per_step=10.0, compute_fraction=0.5):
        self.model = model
        self.inputs = ((4, 2),)
        self.measured = SimpleNamespace(ops_per_step=ops, ms_per_step=ms_per_step, compute_fraction=compute_fraction)
        self.calls_per_step = 1


class Unit:
    """What graph_capture's pay-back rule reads of its unit: the run's backend, cache and options; its figures."""

    _too_short = graph_capture.GraphCapture._too_short
    _estimate_one_off = graph_capture.GraphCapture._estimate_one_off
    _estimate_params = graph_capture.GraphCapture._estimate_params
    _replay_offered = graph_capture.GraphCapture._replay_offered

    def __init__(self, cache=None, backend=None):
        options = SimpleNamespace(exact_random=False)
        self.run = SimpleNamespace(backend=backend or cpu(), cache=cache, options=options)
        self.report = SimpleNamespace(figures={})
        self._estimate = None


def test_a_plain_loop_of_unknown_length_is_not_refused_as_too_short(monkeypatch):
    monkeypatch.setattr(graph_capture.run_length, "remaining_steps", lambda: None)
    for ops in (100, 2500):
        assert Unit()._too_short(Profile(nn.Linear(2, 2), ops)) is None


def test_a_regional_capture_is_judged_on_the_share_of_the_saving_it_keeps(monkeypatch):
    blocks = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))  # every parameter in a block
    monkeypatch.setattr(graph_capture.run_length, "remaining_steps", lambda: (1000, "a framework"))
    unit = Unit()
    too_short = unit._too_short(Profile(blocks, 2500))
    assert unit.report.figures["capture_tier"] == "regional"
    saved_per_step_s = 0.010 * 0.5 * one_offs.REGIONAL_KEEPS
    estimate = CpuBackend.capture_one_off_rate_s * math.sqrt(2500 / 3)  # one block of three compiled
    assert too_short["most"] == pytest.approx(1000 * saved_per_step_s)
    assert too_short["estimate"] == pytest.approx(estimate)


def test_known_remaining_steps_that_cannot_pay_the_estimate_start_no_trial(monkeypatch):
    monkeypatch.setattr(graph_capture.run_length, "remaining_steps", lambda: (1000, "a framework"))
    # 1000 steps saving 5 ms each: 5 s. A 100-op model is estimated at 8 s, a 16-op one at the 2 s floor.
    too_short = Unit()._too_short(Profile(nn.Linear(2, 2), 100))
    assert too_short["estimate"] == pytest.approx(8.0) and too_short["most"] == pytest.approx(5.0)
    assert {"low", "high", "basis", "model", "backend"} <= set(too_short)
    assert Unit()._too_short(Profile(nn.Linear(2, 2), 16)) is None


def test_the_rule_learns_from_the_machines_records(monkeypatch, tmp_path):
    monkeypatch.setattr(graph_capture.run_length, "remaining_steps", lambda: (1000, "a framework"))
    cache = Cache(str(tmp_path), 1 << 30)
    fast = {"size": 10.0, "actual_s": 1.0, "warm": False, "tier": "whole"}  # 0.1 s per unit, measured here
    for _ in range(20):
        one_offs.remember(cache, cpu(), fast)
    # The prior's 8 s would refuse; this machine's measurements bring it to the 2 s floor, within the 5 s saved.
    assert Unit(cache)._too_short(Profile(nn.Linear(2, 2), 100)) is None


class Blobs(CpuBackend):
    """torch.compile's caches as a blob the test sees: ``compiled`` is what this process compiled."""

    def __init__(self, compiled=b"kernels"):
        super().__init__("test")
        self.compiled = compiled
        self.loaded = []

    def save_compile_artifacts(self):
        return self.compiled

    def load_compile_artifacts(self, data):
        self.loaded.append(data)
        return bool(data)


def key(**changes):
    return {
        "script": "/work/train.py",
        "script_content": "abc",
        "model": "m1",
        "inputs": "i1",
        "torch": "2.13.0",
        "device": "cpu: x86_64 CPU, 2 cores",
        "exact_random": False,
        **changes,
    }


def test_compiled_caches_saved_by_one_run_are_loaded_by_the_next_with_the_same_key(tmp_path):
    cache = Cache(str(tmp_path), 1 << 30)
    assert one_offs.load_artifacts(cache, key(), Blobs()) == {"status": "miss", "reason": "first", "changed": []}
    assert one_offs.save_artifacts(cache, key(), Blobs(b"kernels of run 1"))
    later = Blobs()
    assert one_offs.load_artifacts(cache, key(), later) == {"status": "hit", "reason": "loaded", "changed": []}
    assert later.loaded == [b"kernels of run 1"]


@pytest.mark.parametrize("part", ["script_content", "model", "inputs", "torch", "device", "exact_random"])
def test_a_changed_script_model_torch_or_device_misses_and_says_what_changed(tmp_path, part):
    cache = Cache(str(tmp_path), 1 << 30)
    one_offs.save_artifacts(cache, key(), Blobs())
    later = Blobs()
    figures = one_offs.load_artifacts(cache, key(**{part: "another"}), later)
    assert figures == {"status": "miss", "reason": "changed", "changed": [part]} and later.loaded == []


def test_a_new_key_replaces_the_scripts_blob_and_an_evicted_or_broken_one_misses(tmp_path):
    cache = Cache(str(tmp_path), 1 << 30)
    one_offs.save_artifacts(cache, key(), Blobs())
    one_offs.save_artifacts(cache, key(model="m2"), Blobs())
    blobs = list((tmp_path / "compile" / "artifacts").glob("*.bin"))
    assert len(blobs) == 1  # the superseded blob went
    assert one_offs.load_artifacts(cache, key(model="m2"), Blobs())["status"] == "hit"
    blobs[0].unlink()
    assert one_offs.load_artifacts(cache, key(model="m2"), Blobs())["reason"] == "evicted"
    one_offs.save_artifacts(cache, key(model="m2"), Blobs())

    class Broken(Blobs):
        def load_compile_artifacts(self, data):
            raise RuntimeError("another torch build")

    assert one_offs.load_artifacts(cache, key(model="m2"), Broken())["reason"] == "unreadable"


def test_no_cache_no_script_or_nothing_compiled_saves_nothing(tmp_path):
    cache = Cache(str(tmp_path), 1 << 30)
    assert one_offs.load_artifacts(None, key(), Blobs())["reason"] == "no_cache"
    assert one_offs.load_artifacts(cache, None, Blobs())["reason"] == "no_script"
    assert not one_offs.save_artifacts(cache, None, Blobs())
    assert not one_offs.save_artifacts(cache, key(), Blobs(compiled=None))
    assert not (tmp_path / "compile").exists()


def test_saved_artifacts_make_the_estimate_a_warm_compiles(tmp_path, monkeypatch):
    monkeypatch.setattr(graph_capture.run_length, "remaining_steps", lambda: None)
    monkeypatch.setattr(one_offs, "artifacts_key", lambda *args: key())
    cache = Cache(str(tmp_path), 1 << 30)
    profile = Profile(nn.Linear(2, 2), 2500)
    cold = Unit(cache)
    cold._estimate_one_off(profile)
    one_offs.save_artifacts(cache, key(), Blobs())
    warm = Unit(cache)
    warm._estimate_one_off(profile)
    assert warm._estimate["warm"] and not cold._estimate["warm"]
    assert warm._estimate["seconds"] < cold._estimate["seconds"]


def test_regional_is_chosen_where_it_pays_back_better(monkeypatch):
    monkeypatch.setattr(one_offs, "REGIONAL_KEEPS", 0.5)  # the rule, whatever the measured share
    whole = {"seconds": 20.0, "tier": "whole"}
    regional = {"seconds": 8.0, "tier": "regional"}  # 8 s for half the saving: pays back after 16 s of savings
    assert one_offs.choose([whole, regional], 0.01, None) is regional
    assert one_offs.choose([whole, {"seconds": 12.0, "tier": "regional"}], 0.01, None) is whole  # 24 s: later
    # Known steps: 3000 saving 10 ms each, 30 s: whole nets 10 s, regional 15 - 8 = 7 s.
    assert one_offs.choose([whole, regional], 0.01, 3000) is whole
    assert one_offs.choose([whole, regional], 0.01, 2000) is regional  # 0 s against 2 s
    assert one_offs.choose([whole, None], 0.01, 2000) is whole
    assert one_offs.choose([whole, {"seconds": 10.0, "tier": "regional"}], 0.01, None) is whole  # equal: whole


class Replaying(CpuBackend):
    """A backend with a replay tier (CUDA's): a trace's one-off at a rate of its own."""

    replay_one_off_rate_s = 0.05
    least_replay_one_off_s = 0.5


def test_the_replay_tier_has_a_rate_and_floor_of_its_own_and_learns_apart_from_compiles():
    traits = one_offs.traits(nn.Linear(2, 2), 2500)  # size 50
    backend = Replaying("test")
    replay = one_offs.estimate(traits, [], backend, tier="replay")
    assert replay["tier"] == "replay" and replay["seconds"] == pytest.approx(0.05 * 50)
    assert one_offs.estimate(one_offs.traits(nn.Linear(2, 2), 1), [], backend, tier="replay")["seconds"] == 0.5
    slow_compiles = [{"size": 50.0, "actual_s": 100.0, "warm": False, "tier": "whole"}] * 10
    assert one_offs.estimate(traits, slow_compiles, backend, tier="replay") == replay  # compiles do not move it
    slow_replays = [{"size": 50.0, "actual_s": 10.0, "warm": False, "tier": "replay"}] * 10
    learned = one_offs.estimate(traits, slow_replays, backend, tier="replay")
    assert learned["seconds"] > replay["seconds"] and learned["measured"] == 10
    assert one_offs.estimate(traits, slow_replays, backend) == one_offs.estimate(traits, [], backend)


def test_replay_is_chosen_for_a_short_or_open_run_and_a_compile_where_its_fusion_pays_more(monkeypatch):
    monkeypatch.setattr(one_offs, "REPLAY_KEEPS", 0.7)  # where a compiler's fused kernels save more
    whole = {"seconds": 20.0, "tier": "whole"}
    replay = {"seconds": 2.0, "tier": "replay"}  # 70% of the saving for a tenth of the one-off
    assert one_offs.choose([whole, None, replay], 0.01, None) is replay
    assert one_offs.choose([whole, None, replay], 0.01, 1000) is replay  # 10 s saved: 5 s net against -10 s
    assert one_offs.choose([whole, None, replay], 0.01, 100_000) is whole  # 980 s net against 698 s


@pytest.mark.parametrize(
    ("backend", "calls", "exact_random", "offered"),
    [
        (Replaying, 1, False, True),
        (CpuBackend, 1, False, False),
        (Replaying, 2, False, False),
        (Replaying, 1, True, False),
    ],
)
def test_the_unit_offers_the_replay_tier_only_where_the_backend_has_it_and_it_can_replay(
    monkeypatch, backend, calls, exact_random, offered
):
    monkeypatch.setattr(graph_capture.run_length, "remaining_steps", lambda: None)
    unit = Unit(backend=backend("test"))
    unit.run.options.exact_random = exact_random
    profile = Profile(nn.Linear(2, 2), 2500)
    profile.calls_per_step = calls
    unit._estimate_one_off(profile)
    assert ("one_off_predicted_replay_s" in unit.report.figures) is offered
    assert unit.report.figures["capture_tier"] == ("replay" if offered else "whole")


def test_the_benchmark_table_shows_predicted_against_actual_and_whole_against_regional():
    import importlib.util
    import sys

    from tests.helpers import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("one_offs_benchmark", REPO / "benchmarks" / "one_offs.py")
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    run = {
        "seconds": 30.0,
        "steps_per_s": 2.5,
        "load_before": 1.0,
        "load_after": 1.5,
        "one_off_predicted_s": 20.4,
        "one_off_predicted_range_s": [10.2, 40.8],
        "one_off_actual_s": 18.7,
        "one_off_s": 19.9,
        "compile_artifacts": "miss",
        "artifacts_reason": "first",
    }
    region = {"one_off_predicted_s": 9.5, "one_off_actual_s": 11.0, "load_before": 1.0, "load_after": 1.0}
    results = {
        "machine": "test-machine",
        "runs": {"chargpt": {"quick": False, "first": run, "second": {**run, "compile_artifacts": "hit"}}},
        "regions": {
            "gpt4": {
                "eager": {"steady_ms_per_step": 30.0, "load_before": 1.0, "load_after": 1.0},
                "regional": {**region, "steady_ms_per_step": 20.0},
            }
        },
    }
    table = benchmark.markdown(results)
    assert "| chargpt | first | 20.4 | 10.2-40.8 | 18.7 | 19.9 | miss (first) | 30.0 | 2.5 | 1.0/1.5 |" in table
    assert "| gpt4 | regional | 9.5 | 11.0 | 20.0 | 1.50x | 1.0/1.0 |" in table


def saved(tmp_path, data=b"kernels of run 1"):
    """A cache in which a run saved ``data`` for key(); (cache, the index, the blob)."""
    cache = Cache(str(tmp_path / "cache"), 1 << 30)
    assert one_offs.save_artifacts(cache, key(), Blobs(data))
    (index,) = (tmp_path / "cache" / "compile" / "artifacts").glob("*.json")
    (blob,) = (tmp_path / "cache" / "compile" / "artifacts").glob("*.bin")
    return cache, index, blob


def test_a_planted_blob_whose_digest_does_not_match_is_never_loaded(tmp_path):
    cache, _index, blob = saved(tmp_path)
    blob.write_bytes(b"another user's pickle")
    later = Blobs()
    assert one_offs.load_artifacts(cache, key(), later)["reason"] == "digest_mismatch"
    assert later.loaded == []


@pytest.mark.parametrize("how", CORRUPTIONS)
@pytest.mark.parametrize("spoilt", ["index", "blob"])
def test_a_spoilt_artifact_file_is_never_handed_to_the_backend(tmp_path, spoilt, how):
    cache, index, blob = saved(tmp_path)
    if spoilt == "blob" and how == "wrong_schema":
        pytest.skip("a blob is torch's bytes, not JSON: it has no schema of autogaudi's")
    wrong = json.dumps({"key": key(), "blob": blob.name, "sha256": 5, "date": "today"}).encode()
    corrupt(index if spoilt == "index" else blob, how, tmp_path / "outside", wrong=wrong)
    later = Blobs()
    expected = {"index": "invalid", "blob": "untrusted" if how == "symlinked_out" else "digest_mismatch"}
    assert one_offs.load_artifacts(cache, key(), later)["reason"] == expected[spoilt]
    assert later.loaded == []


@pytest.mark.parametrize("level", ["root", "folder", "blob"])
@pytest.mark.parametrize("how", ["writable_by_others", "writable_by_group", "other_owner"])
def test_artifacts_another_user_could_write_are_loaded_only_with_cache_trust_shared(tmp_path, how, level):
    _cache, _index, blob = saved(tmp_path)
    path = {"root": tmp_path / "cache", "folder": blob.parent, "blob": blob}[level]
    if how == "other_owner":
        if os.geteuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
    else:
        modes = {("writable_by_others", True): 0o777, ("writable_by_group", True): 0o770}
        os.chmod(path, modes.get((how, path.is_dir()), 0o666 if how == "writable_by_others" else 0o660))
    later = Blobs()
    assert one_offs.load_artifacts(Cache(str(tmp_path / "cache"), 1 << 30), key(), later)["reason"] == "untrusted"
    assert later.loaded == []
    trusting = Cache(str(tmp_path / "cache"), 1 << 30, trust_shared=True)
    assert one_offs.load_artifacts(trusting, key(), later)["reason"] == "loaded"
    assert later.loaded == [b"kernels of run 1"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_a_spoilt_records_file_is_dropped_and_the_prior_used(tmp_path, how):
    cache = Cache(str(tmp_path / "cache"), 1 << 30)
    one_offs.remember(cache, cpu(), {"size": 10.0, "actual_s": 1.0, "warm": False, "tier": "whole"})
    assert len(one_offs.remembered(cache, cpu())) == 1
    corrupt(pathlib.Path(one_offs.records_path(cache, cpu())), how, tmp_path / "outside", wrong=b'{"records": "zzz"}')
    assert one_offs.remembered(cache, cpu()) == []
    assert [note.code for note in cache.notes] == ["entry_invalid"]


@pytest.mark.parametrize(
    "record", [{"size": "zzz", "actual_s": 1.0}, {"size": 10.0}, {"size": 10.0, "actual_s": 1.0, "tier": "zzz"}, "zzz"]
)
def test_a_record_that_is_not_what_autogaudi_writes_is_dropped_alone(tmp_path, record):
    cache = Cache(str(tmp_path / "cache"), 1 << 30)
    good = {"size": 10.0, "actual_s": 1.0, "warm": False, "tier": "whole"}
    cache.write_json(one_offs.records_path(cache, cpu()), {"records": [record, good]})
    assert one_offs.remembered(cache, cpu()) == [good]
    assert [note.code for note in cache.notes] == ["entry_invalid"]
