"""The standard way a replay (a benchmark, a test) serves one request through an offloading
manager, ours or vLLM's (their calls have the same names). Below every user of it: it needs only
the manager contract."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult, OffloadingManager, ReqContext

__all__ = ["serve_request"]

_HIT = LookupResult.HIT


def serve_request(
    manager: OffloadingManager,
    keys: Sequence[OffloadKey],
    ctx: ReqContext,
    *,
    hit: object = _HIT,
    touch: bool = True,
    finish: Callable[[Any], object] | None = None,
) -> int:
    """Serve one request whose blocks are ``keys`` (prefix order); return its prefix hits.

    Lookup until the first answer that is not ``hit``, load the hits (``prepare_load`` /
    ``complete_load``), touch every key (unless ``touch`` is false: vLLM's scheduler never
    does), store the rest (``prepare_store`` / ``complete_store``), then finish: take the events
    and ``request_finished``, or ``finish(ctx)`` when given (vLLM's ``on_request_finished``).
    The operation stream the hot-path and trace benchmarks replay, for our managers and (with
    vLLM's ``hit`` answer and context) for vLLM's.
    """
    lookup = manager.lookup
    n = 0
    for key in keys:
        if lookup(key, ctx) is not hit:
            break
        n += 1
    if n:
        loaded = keys[:n]
        manager.prepare_load(loaded, ctx)
        manager.complete_load(loaded, ctx)
    if touch:
        manager.touch(keys, ctx)
    out = manager.prepare_store(keys[n:], ctx)
    if out is not None and out.keys_to_store:
        manager.complete_store(out.keys_to_store, ctx)
    if finish is None:
        manager.take_events()
        manager.request_finished(ctx)
    else:
        finish(ctx)
    return n
