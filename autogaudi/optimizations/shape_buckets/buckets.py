"""Bucket lengths chosen from the lengths seen: the fewest graphs whose padding stays within a
budget, and for that many graphs the fewest padded positions.

Why: each bucket is one graph to compile (tens of seconds under ``torch.compile`` on a CPU, and a
second shape there makes torch recompile the graph with dynamic sizes, whose steps ran several times
slower than the static graph's); each length padded up to its bucket costs the positions in between,
in every step. So the fewest buckets whose padding is at most ``PADDING_BUDGET`` of the positions,
at most ``most`` of them; for a given count, the best buckets are an exact dynamic programme over the
sorted distinct lengths (the longest is always a bucket, or it would have nowhere to go). A length
longer than every bucket later gets a new bucket of its own, rounded up to ``OVERFLOW_STEP`` so that
the next few longer ones share it.
"""

from __future__ import annotations

import collections

OVERFLOW_STEP = 8
PADDING_BUDGET = 0.1  # the share of positions that may be padding before one more graph is worth it


def choose(lengths, most: int, budget: float = PADDING_BUDGET) -> tuple:
    """The fewest bucket lengths (ascending, at most ``most``) that pad ``lengths`` (the lengths seen,
    one per batch) by at most ``budget`` of the positions, else the ``most`` that pad the fewest."""
    counts = collections.Counter(lengths)
    for count in range(1, most):
        chosen = fewest_padded(counts, count)
        padded = sum(n * (bucket_for(length, chosen) - length) for length, n in counts.items())
        if padded <= budget * sum(n * bucket_for(length, chosen) for length, n in counts.items()):
            return chosen
    return fewest_padded(counts, most)


def fewest_padded(counts, most: int) -> tuple:
    """The bucket lengths (ascending, at most ``most``) that pad the lengths ``counts`` (length -> how
    many batches) by the fewest positions in all."""
    distinct = sorted(counts)
    if len(distinct) <= most:
        return tuple(distinct)
    n = len(distinct)

    def cost(low: int, high: int) -> int:  # distinct[low..high] all padded up to distinct[high]
        return sum(counts[distinct[i]] * (distinct[high] - distinct[i]) for i in range(low, high + 1))

    # best[k][j]: the least cost of distinct[0..j] with k buckets, the last at distinct[j]
    infinity = float("inf")
    best = [[infinity] * n for _ in range(most + 1)]
    came_from = [[-1] * n for _ in range(most + 1)]
    for j in range(n):
        best[1][j] = cost(0, j)
    for k in range(2, most + 1):
        for j in range(n):
            for i in range(j):
                value = best[k - 1][i] + cost(i + 1, j)
                if value < best[k][j]:
                    best[k][j], came_from[k][j] = value, i
    k = min(range(1, most + 1), key=lambda kk: best[kk][n - 1])
    chosen, j = [], n - 1
    while j >= 0 and k >= 1:
        chosen.append(distinct[j])
        j, k = came_from[k][j], k - 1
    return tuple(sorted(chosen))


def bucket_for(length: int, buckets: tuple):
    """The smallest bucket that holds ``length``, or None where every bucket is shorter."""
    return next((bucket for bucket in buckets if bucket >= length), None)


def overflow(length: int) -> int:
    """A new bucket for a length past every bucket."""
    return -(-length // OVERFLOW_STEP) * OVERFLOW_STEP
