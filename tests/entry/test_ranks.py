"""Rank awareness: the store-based gathering of every rank's unit rows and how rank 0 reports them."""

import time

import torch.distributed as dist

import autogaudi
from autogaudi.entry.ranks import gather_through_store
from tests.helpers import bare_report


def test_rank_zero_gathers_what_the_others_posted_and_names_the_silent_ones():
    store = dist.HashStore()
    assert gather_through_store(store, 1, 3, "from one", timeout_s=5) is None  # other ranks only post
    start = time.perf_counter()
    gathered = gather_through_store(store, 0, 3, "from zero", timeout_s=0.3)  # rank 2 never answers
    assert gathered == {0: "from zero", 1: "from one", 2: None}
    assert time.perf_counter() - start < 30  # bounded by the timeout, never a hang (100x it: a loaded machine too)


def rows(**statuses):
    return [{"name": name, "status": status} for name, status in statuses.items()]


def report_with(ranks):
    return bare_report(ranks=ranks)


def test_the_report_says_whether_the_ranks_decided_alike():
    same = report_with({0: rows(fast_ddp="applied"), 1: rows(fast_ddp="applied")})
    assert "ranks    2 of 2 reported their unit decisions; all the same" in same.format(verbose=True)
    differing = report_with(
        {0: rows(fast_ddp="applied", ddp_tuning="applied"), 1: rows(fast_ddp="failed", ddp_tuning="applied"), 2: None}
    )
    assert (
        "ranks    2 of 3 reported their unit decisions (no answer from rank 2); "
        "they differ: fast_ddp: rank 0 applied, rank 1 failed"
    ) in differing.format(verbose=True)
    assert differing.as_dict()["ranks"]["2"] is None and differing.as_dict()["ranks"]["1"][0]["status"] == "failed"


def test_single_process_reports_have_no_ranks_line():
    assert "ranks" not in report_with(None).format(verbose=True) and report_with(None).as_dict()["ranks"] is None


def test_a_store_that_fails_costs_the_ranks_line_only_not_the_report(monkeypatch, capsys):
    from autogaudi.core import session
    from autogaudi.entry import runtime

    def broken_store(_payload):
        raise RuntimeError("store unreachable")

    autogaudi.enable(device="cpu")
    monkeypatch.setattr(session, "several_ranks", lambda: True)
    monkeypatch.setattr(session, "gather_from_ranks", broken_store)
    runtime._STATE.session.finish(explicit=True)
    printed = capsys.readouterr().err
    assert "could not gather the other ranks' unit decisions: RuntimeError('store unreachable')" in printed
    assert "autogaudi 0.1.0 report" in printed and "ranks    " not in printed
