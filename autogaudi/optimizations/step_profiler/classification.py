"""The classification of a step as input-, host-, communication- or device-bound, from the pairs of
a clean step and a census step (thresholds stated in docs/units/step_profiler.md).

Input-bound when waiting for data is at least half of a step; else host-bound when ops compute and
waits for collectives together take less than half of a step (the rest is Python, dispatch and
launch overhead: what graph capture removes); otherwise communication-bound when the collectives
hold more of it than the ops, else device-bound. Each census step is set against its own neighbour
and the median pair decides (why: docs/units/step_profiler.md). A median within the pairs' own noise
of the host-bound line is *unclear*: there identical runs read one side or the other by chance (a
busy machine's scheduling), and a unit that needs a host-bound step takes it as not.
"""

from __future__ import annotations

from autogaudi.measure.trials import median
from autogaudi.optimizations.step_profiler.profile import StepFigures

PAIRS = 5
# A majority of PAIRS: where that many pairs read alike (a single process's census), the rest are not taken.
DECIDING_PAIRS = PAIRS // 2 + 1
INPUT_BOUND = 0.5
HOST_BOUND = 0.5
# The noise band around HOST_BOUND: the pairs' spread (half the range of their shares: of five
# pairs, steadier than their median deviation, which reads near zero by chance where a busy machine
# shifts every pair alike), at least MIN_BAND (a quiet machine's census still varies by a few
# percent) and at most MAX_BAND (so that pairs beyond it settle the census early whatever the others
# would read). On a busy machine (more runnable processes than cores) the band is MAX_BAND: five pairs
# cannot show noise that shifts them all alike. Tried on generated runs (tests): no flip between
# identical runs with 2-5% noise per pair on a quiet machine, nor with 2-15% on a busy one.
MIN_BAND = 0.05
MAX_BAND = 0.15


def _share(fraction: float) -> str:
    # Census steps run slower than the clean steps, so what they measure can exceed a clean step.
    return "all" if fraction >= 1 else f"{fraction:.0%}"


def noise_band(spread: float) -> float:
    return min(max(MIN_BAND, spread), MAX_BAND)


def classify(waiting: float, busy: float, collective: float = 0.0, spread: float = 0.0) -> tuple:
    """(``"input"`` / ``"host"`` / ``"communication"`` / ``"device"`` / ``"unclear"``, why) for the
    fractions of a step spent waiting for data, computing ops and waiting for collectives (gradient
    all-reduce); ``spread``: the census pairs' noise (:func:`census_figures`: half the range of
    their shares), which sets the band around the host-bound line (:func:`noise_band`)."""
    if waiting >= INPUT_BOUND:
        return "input", f"waiting for data {waiting:.0%} of each step"
    compute = f"ops compute {_share(busy)}"
    held = f" and collectives hold {_share(collective)}" if collective else ""
    band = noise_band(spread)
    if abs(busy + collective - HOST_BOUND) < band:
        return "unclear", (
            f"{compute}{held} of each step, within {band:.0%} of the host-bound line ({HOST_BOUND:.0%}), "
            "the census's own noise: neither host- nor device-bound"
        )
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
    its share decides, so once ``DECIDING_PAIRS`` (a majority) read alike beyond the widest noise
    band, on the same side of the host-bound line, the pairs still to come cannot move the median
    across it or into the band. (The input share is then a total over fewer clean steps, and device
    against communication, where a single process runs collectives at all, is read on the pairs
    taken.)"""
    if len(censuses) < DECIDING_PAIRS:
        return False
    waiting = waiting_share(clean)
    pairs = pair_shares(clean, censuses)
    read = {classify(waiting, busy, collective, MAX_BAND)[0] for _, busy, collective in pairs}
    return len(read) == 1 and read != {"unclear"}


def census_figures(clean: list, censuses: list, busy_machine: bool = False) -> tuple:
    """The step's figures, and the (input wait, ops computing, collective wait) shares of a step with
    the pairs' spread, which :func:`classify` reads, from the clean steps' (seconds, seconds waiting
    for data) and the census steps' (ops, busy seconds, collective wait seconds or None, collectives
    without a future); ``busy_machine``: the pairs' spread taken as :data:`MAX_BAND`."""
    step_s = median(seconds for seconds, _waited in clean)
    waiting = waiting_share(clean)
    # The median pair by its sum decides (an odd number of pairs: PAIRS, or DECIDING_PAIRS).
    pairs = pair_shares(clean, censuses)
    _, busy_share, collective_share = pairs[len(pairs) // 2]
    busy = sorted(share for _, share, _ in pairs)
    figures = StepFigures(
        ms_per_step=round(1000 * step_s, 3),
        input_wait_fraction=round(waiting, 3),
        ops_per_step=int(median(ops for ops, *_ in censuses)),
        compute_fraction=round(min(busy_share, 1.0), 3),
        compute_fraction_range=[round(min(busy[0], 1.0), 3), round(min(busy[-1], 1.0), 3)],
    )
    if any(collective_s is not None for _ops, _busy, collective_s, _unfutured in censuses):
        figures.collective_wait_fraction = round(min(collective_share, 1.0), 3)
    unfutured = median(unfutured for *_, unfutured in censuses)
    if unfutured:  # their waits are measured up to the next op only (census._Census._completion)
        figures.collectives_without_future_per_step = unfutured
    spread = MAX_BAND if busy_machine else (pairs[-1][0] - pairs[0][0]) / 2
    return figures, (waiting, busy_share, collective_share, spread)


def census_extra_s(clean: list, census_seconds: list) -> float:
    """What the census steps took beyond as many clean steps (their median): autogaudi's own
    measuring, which the report counts against the run."""
    if not census_seconds:
        return 0.0
    step_s = median(seconds for seconds, _waited in clean)
    return max(0.0, sum(census_seconds) - len(census_seconds) * step_s)
