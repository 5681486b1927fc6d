"""Bucket lengths chosen from the lengths seen: the fewest padded positions for at most a given
number of graphs.

Why: each bucket is one graph to compile; each length padded up to its bucket costs the positions in
between. Given how often each length came, the best ``most`` buckets are an exact dynamic programme
over the sorted distinct lengths (the longest is always a bucket, or it would have nowhere to go). A
length longer than every bucket later gets a new bucket of its own, rounded up to ``OVERFLOW_STEP``
so that the next few longer ones share it.
"""

from __future__ import annotations

import collections

OVERFLOW_STEP = 8


def choose(lengths, most: int) -> tuple:
    """The bucket lengths (ascending, at most ``most``) that pad ``lengths`` (an iterable of the lengths
    seen, one per batch, or a Counter) by the fewest positions in all."""
    counts = collections.Counter(lengths)
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

