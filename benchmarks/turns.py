"""The order in which the benchmark's tools take their turns, round by round.

On this VM a cold load depends on the load just before it, not only on its own work: with
loads in random order, dist_ckpt's same-layout 2-rank load took 0.592 s (median of 10) right
after raw I/O's one-thread loop had read the same files, and 0.530 and 0.544 s after the
placement floor's 4 -> 2 load or raw I/O's own file; the floor's same-layout load took
0.541-0.550 s after any of the three. A fixed cyclic order that rotates between rounds gives
each tool every position but always the same predecessor, so such an effect lands on one tool
in every round (it did: dist_ckpt's same-layout load always came right after that loop).

``balanced_orders`` is a Williams design (a balanced Latin square): over its rounds each tool
takes each position equally often and comes right after each other tool equally often, so what
one load leaves behind falls on every tool alike.
"""

from __future__ import annotations

from typing import List

__all__ = ["balanced_orders"]


def balanced_orders(count: int) -> List[List[int]]:
    """Orders of ``count`` tools (their indices), one per round, to be used in turn: ``count``
    orders for an even count, ``2 * count`` for an odd one (the orders and their reverses).
    Over them every ordered pair of distinct tools is adjacent equally often (once for an even
    count, twice for an odd one) and every tool takes every position equally often."""
    if count < 1:
        raise ValueError(f"balanced_orders needs at least one tool, got {count}")
    first, low, high = [0], 1, count - 1
    while len(first) < count:  # 0, 1, n-1, 2, n-2, ...
        first.append(low)
        low += 1
        if len(first) < count:
            first.append(high)
            high -= 1
    orders = [[(tool + shift) % count for tool in first] for shift in range(count)]
    if count % 2:
        orders += [order[::-1] for order in orders]
    return orders
