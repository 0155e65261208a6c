"""Serve one request through a vLLM ``OffloadingManager`` the way vLLM's scheduler-side
connector does (no GPU): the operation stream of the trace benchmark and the op-stream tests."""

from __future__ import annotations

from collections.abc import Sequence

from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, OffloadKey, ReqContext

from kvoffload.managers.replay import serve_request as serve

__all__ = ["serve_request"]


def serve_request(
    manager: OffloadingManager,
    keys: Sequence[OffloadKey],
    req_id: str,
    tokens_per_block: int = 16,
) -> int:
    """Serve a request whose blocks are ``keys`` (prefix order); return its prefix hits.

    As vLLM 0.33's ``OffloadingConnectorScheduler``: record each key's end-token position,
    ``on_new_request``, then the loop of :func:`kvoffload.managers.replay.serve_request`
    (``lookup`` until the first non-hit, load the hits, store the rest as after a whole prefill)
    without ``touch`` (vLLM's scheduler never calls it), ``on_request_finished``.
    """
    ctx = ReqContext(req_id=req_id)
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * tokens_per_block)
    manager.on_new_request(ctx)
    return serve(
        manager,  # type: ignore[arg-type]  # vLLM's manager: the same call names
        keys,  # type: ignore[arg-type]
        ctx,  # type: ignore[arg-type]
        hit=LookupResult.HIT,
        touch=False,
        finish=manager.on_request_finished,
    )


#: vLLM's built-in cache policies and ours, by the names ``eviction_policy`` takes.
POLICY_MODULE = "kvoffload.integrations.vllm.policies"


def hit_ratio(
    requests: Sequence[Sequence[int]],
    keys: dict[int, OffloadKey],
    policy: str,
    capacity: int,
    module_path: str | None = None,
) -> float:
    """Prefix-hit ratio (hits / blocks) of vLLM's ``CPUOffloadingManager`` with cache policy
    ``policy`` (vLLM's ``"lru"``/``"arc"``, or a class of ``module_path``) and ``capacity``
    chunks, every request served by :func:`serve_request` (block id ``b`` is ``keys[b]``)."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    manager = CPUOffloadingManager(
        num_chunks=capacity, cache_policy=policy, cache_policy_module_path=module_path
    )
    hits = total = 0
    for i, ids in enumerate(requests):
        hits += serve_request(manager, [keys[b] for b in ids], f"req-{i}")
        total += len(ids)
    return hits / max(total, 1)
