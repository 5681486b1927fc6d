"""The classification of a step as input-, host-, communication- or device-bound, from the pairs of
a clean step and a census step (thresholds stated in docs/units/step_profiler.md).

Input-bound when waiting for data is at least half of a step; else host-bound when ops compute and
waits for collectives together take less than half of a step (the rest is Python, dispatch and
launch overhead: what graph capture removes); otherwise communication-bound when the collectives
hold more of it than the ops, else device-bound. Each census step is set against its own neighbour
and the median pair decides (why: docs/units/step_profiler.md).
"""

from __future__ import annotations

import statistics

from autogaudi.optimizations.step_profiler.profile import StepFigures

PAIRS = 5
# A majority of PAIRS: where that many pairs read alike (a single process's census), the rest are not taken.
DECIDING_PAIRS = PAIRS // 2 + 1
INPUT_BOUND = 0.5
HOST_BOUND = 0.5


def _share(fraction: float) -> str:
    # Census steps run slower than the clean steps, so what they measure can exceed a clean step.
    return "all" if fraction >= 1 else f"{fraction:.0%}"


def classify(waiting: float, busy: float, collective: float = 0.0) -> tuple:
    """(``"input"`` / ``"host"`` / ``"communication"`` / ``"device"``, why) for the fractions of a
    step spent waiting for data, computing ops and waiting for collectives (gradient all-reduce)."""
    if waiting >= INPUT_BOUND:
        return "input", f"waiting for data {waiting:.0%} of each step"
    compute = f"ops compute {_share(busy)}"
    held = f" and collectives hold {_share(collective)}" if collective else ""
    if busy + collective < HOST_BOUND:
        return "host", f"{compute}{held} of each step; issuing the ops (Python, dispatch) takes the rest"
    if collective > busy:
        return "communication", f"waiting for collectives {_share(collective)} of each step, {compute}"
    return "device", f"{compute}{held} of each step"


def pair_shares(clean: list, censuses: list) -> list:
    """Per pair, (busy + collective wait, busy, collective wait) as shares of its clean step, sorted:
    from the clean steps' (seconds, seconds waiting for data) and the census steps' (ops, busy
    seconds, collective wait seconds or None, collectives without a future)."""
    return sorted(
        ((busy_s + (collective_s or 0.0)) / seconds, busy_s / seconds, (collective_s or 0.0) / seconds)
        for (seconds, _waited), (_ops, busy_s, collective_s, _unfutured) in zip(clean, censuses)
    )


def waiting_share(clean: list) -> float:
    """Of the clean steps' time, the share spent waiting for data (a total: workers hand batches over
    in bursts)."""
    return sum(waited for _seconds, waited in clean) / sum(seconds for seconds, _waited in clean)


def settled(clean: list, censuses: list) -> bool:
    """Whether the pairs measured so far already decide what all ``PAIRS`` would: the median pair by
    its share decides, so once ``DECIDING_PAIRS`` (a majority) read alike, on the same side of the
    host-bound line, the pairs still to come cannot move the median across it. (The input share is
    then a total over fewer clean steps, and device against communication, where a single process
    runs collectives at all, is read on the pairs taken.)"""
    if len(censuses) < DECIDING_PAIRS:
        return False
    waiting = waiting_share(clean)
    return len({classify(waiting, busy, collective)[0] for _, busy, collective in pair_shares(clean, censuses)}) == 1


def census_figures(clean: list, censuses: list) -> tuple:
    """The step's figures, and the (input wait, ops computing, collective wait) shares of a step that
    :func:`classify` reads, from the clean steps' (seconds, seconds waiting for data) and the census
    steps' (ops, busy seconds, collective wait seconds or None, collectives without a future)."""
    step_s = statistics.median(seconds for seconds, _waited in clean)
    waiting = waiting_share(clean)
    # The median pair by its sum decides (an odd number of pairs: PAIRS, or DECIDING_PAIRS).
    pairs = pair_shares(clean, censuses)
    _, busy_share, collective_share = pairs[len(pairs) // 2]
    busy = sorted(share for _, share, _ in pairs)
    figures = StepFigures(
        ms_per_step=round(1000 * step_s, 3),
        input_wait_fraction=round(waiting, 3),
        ops_per_step=int(statistics.median(ops for ops, *_ in censuses)),
        compute_fraction=round(min(busy_share, 1.0), 3),
        compute_fraction_range=[round(min(busy[0], 1.0), 3), round(min(busy[-1], 1.0), 3)],
    )
    if any(collective_s is not None for _ops, _busy, collective_s, _unfutured in censuses):
        figures.collective_wait_fraction = round(min(collective_share, 1.0), 3)
    unfutured = statistics.median(unfutured for *_, unfutured in censuses)
    if unfutured:  # their waits are measured up to the next op only (census._Census._completion)
        figures.collectives_without_future_per_step = unfutured
    return figures, (waiting, busy_share, collective_share)
