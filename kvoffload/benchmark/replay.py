"""The standard way a benchmark serves one request through an offloading manager."""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.base import LookupResult, OffloadingManager, ReqContext
from kvoffload.keys import OffloadKey

__all__ = ["serve_request"]

_HIT = LookupResult.HIT


def serve_request(manager: OffloadingManager, keys: Sequence[OffloadKey], ctx: ReqContext) -> int:
    """Serve one request whose blocks are ``keys`` (prefix order); return its prefix hits.

    Lookup until the first miss, load the hits (``prepare_load`` / ``complete_load``), touch every
    key, store the rest (``prepare_store`` / ``complete_store``), take the events, finish the
    request: the operation stream the hot-path and trace benchmarks replay.
    """
    lookup = manager.lookup
    n = 0
    for key in keys:
        if lookup(key, ctx) is not _HIT:
            break
        n += 1
    if n:
        loaded = keys[:n]
        manager.prepare_load(loaded, ctx)
        manager.complete_load(loaded, ctx)
    manager.touch(keys, ctx)
    out = manager.prepare_store(keys[n:], ctx)
    if out is not None and out.keys_to_store:
        manager.complete_store(out.keys_to_store, ctx)
    manager.take_events()
    manager.request_finished(ctx)
    return n
