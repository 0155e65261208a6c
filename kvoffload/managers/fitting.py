"""The longest head of a refused offer that still fits: one binary search, shared by the
connector's store planner and the tiering manager's promotions."""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.manager_contract import PrepareStoreOutput

__all__ = ["reserve_longest_head"]


def reserve_longest_head(
    n: int, reserve: Callable[[int], PrepareStoreOutput | None]
) -> tuple[int, list[PrepareStoreOutput]]:
    """Reserve the longest head of an ``n``-block offer whose whole reservation was refused.

    ``reserve(h)`` is a ``prepare_store`` of the offer's first ``h`` blocks. The search relies on
    the contract: a refusal (``None``) changes nothing; an accepted reservation is kept, so its
    blocks are held and every longer head skips them. Binary search over ``h`` in ``[0, n)``:
    at most ``ceil(log2(n))`` calls, the answer exact whenever every head shorter than one that
    fits fits too (the longest head of 10 blocks when 9 fit is 9, not the 5 that halving gives).

    Returns the head length now held (0: not even one block fits) and the accepted
    reservations that store something, in call order; their ``keys_to_store`` together are the
    head's blocks that were not held before.
    """
    outs: list[PrepareStoreOutput] = []
    fits, refused = 0, n
    while refused - fits > 1:
        mid = (fits + refused) // 2
        out = reserve(mid)
        if out is None:
            refused = mid
            continue
        fits = mid
        if out.keys_to_store:
            outs.append(out)
    return fits, outs
