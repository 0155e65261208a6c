"""Byte planes: the bytes of fixed-size elements regrouped by their position in the element.

``split(raw, width)`` turns elements ``e0 e1 ...`` of ``width`` bytes into ``width`` planes (all
first bytes, then all second bytes, ...); ``join_into`` undoes it. In bf16/fp16/fp32 KV the plane
that holds sign and exponent repeats few values and compresses well, while the mantissa planes
are close to random: an entropy coder gains far more on the planes than on the interleaved bytes.

Joining is the hot step of a load: for widths 2, 4 and 8 on a little-endian machine it builds
the elements as integers (the last plane, shifted left a byte per plane, or-ed with the next;
for width 2 one widening shift into ``out`` and one or), several times faster than numpy's
strided byte copies.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np

__all__ = ["join_into", "split"]

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
_FAST_JOIN = sys.byteorder == "little"


def split(raw: memoryview | bytes, width: int) -> list[memoryview]:
    """The ``width`` byte planes of ``raw`` (whose length is a multiple of ``width``), as views
    of one new buffer."""
    data = np.frombuffer(raw, dtype=np.uint8)
    joined = memoryview(data.reshape(-1, width).T.tobytes())
    n = len(joined) // width
    return [joined[p * n : (p + 1) * n] for p in range(width)]


def join_into(
    planes: Sequence[memoryview | bytes | bytearray], width: int, out: memoryview
) -> None:
    """Write the elements whose byte planes are ``planes`` (``width`` of them, each
    ``len(out) // width`` bytes) into ``out``."""
    kind = _UINT.get(width)
    if kind is not None and _FAST_JOIN:
        # Per block a few ufunc calls (their fixed cost is a tenth of a 64 KiB block's join):
        # the first shift widens the last plane straight into ``out``.
        elements = np.frombuffer(out, dtype=kind)
        np.left_shift(np.frombuffer(planes[-1], np.uint8), 8, out=elements, dtype=kind)
        elements |= np.frombuffer(planes[-2], np.uint8)
        for plane in reversed(planes[:-2]):
            elements <<= 8
            elements |= np.frombuffer(plane, np.uint8)
        return
    dst = np.frombuffer(out, dtype=np.uint8)
    if width == 1:
        dst[:] = np.frombuffer(planes[0], np.uint8)
        return
    rows = dst.reshape(-1, width)
    for p, plane in enumerate(planes):
        rows[:, p] = np.frombuffer(plane, np.uint8)
