"""Our tiers' view of vLLM's shared CPU pool, holding no buffer export of vLLM's mapping.

vLLM's ``SharedOffloadRegion.cleanup`` closes its ``mmap`` at shutdown; ``mmap.close`` fails with
``BufferError: cannot close exported pointers exist`` while any view derived from the pool's
``memoryview`` is alive (a cast or slice keeps the managed buffer, and with it vLLM's numpy array
and torch storage, exporting the mapping). Our tiers slice and cast the pool freely, on their own
threads, and the last such view may outlive ``close()`` in a frame, a traceback or a cycle.

:func:`unexported_alias` gives them a view of the same bytes through a ``ctypes`` array at the
pool's address instead: every view they derive exports that array, never vLLM's mapping, so
vLLM's cleanup always succeeds.

Invariant (the price of an alias): nothing reads or writes the alias after vLLM unmaps the pool.
Both owners keep it: :class:`~kvoffload.integrations.vllm.spec.KVOffloadSpec` closes its tiering
manager (every tier's I/O threads joined) before it cleans the region up, and vLLM's tiering
manager shuts every secondary tier down before its primary tier, and keeps the mapping when a
tier's shutdown fails.
"""

from __future__ import annotations

import ctypes

__all__ = ["unexported_alias"]


def unexported_alias(view: memoryview) -> memoryview:
    """A writable 2-D byte view of the same memory as the C-contiguous, writable 2-D ``view``
    (shape and strides equal), holding no buffer export of ``view``'s object once it returns."""
    shape = view.shape
    if shape is None or view.ndim != 2 or not view.c_contiguous or view.readonly:
        raise ValueError(
            f"expected a writable C-contiguous 2-D view, got ndim={view.ndim} "
            f"contiguous={view.c_contiguous} readonly={view.readonly}"
        )
    rows, row_bytes = shape
    probe = ctypes.c_char.from_buffer(view)  # a temporary export, only to learn the address
    address = ctypes.addressof(probe)
    del probe
    raw = (ctypes.c_ubyte * view.nbytes).from_address(address)
    return memoryview(raw).cast("B").cast("B", (rows, row_bytes))
