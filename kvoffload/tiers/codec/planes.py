"""Byte planes: the bytes of fixed-size elements regrouped by their position in the element.

``split(raw, width)`` turns elements ``e0 e1 ...`` of ``width`` bytes into ``width`` planes (all
first bytes, then all second bytes, ...); ``join`` undoes it. In bf16/fp16/fp32 KV the plane that
holds sign and exponent repeats few values and compresses well, while the mantissa planes are
close to random: an entropy coder gains far more on the planes than on the interleaved bytes.
"""

from __future__ import annotations

import numpy as np

__all__ = ["join_into", "split"]


def split(raw: memoryview | bytes, width: int) -> bytes:
    """The ``width`` byte planes of ``raw`` (whose length is a multiple of ``width``), one after
    the other."""
    data = np.frombuffer(raw, dtype=np.uint8)
    if width == 1:
        return data.tobytes()
    return data.reshape(-1, width).T.tobytes()


def join_into(planes: memoryview | bytes, width: int, out: memoryview) -> None:
    """Write the elements whose byte planes are ``planes`` into ``out`` (same length)."""
    src = np.frombuffer(planes, dtype=np.uint8)
    dst = np.frombuffer(out, dtype=np.uint8)
    if width == 1:
        dst[:] = src
        return
    dst.reshape(-1, width)[:] = src.reshape(width, -1).T
