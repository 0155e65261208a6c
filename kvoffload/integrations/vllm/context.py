"""One kvoffload :class:`~kvoffload.manager_contract.ReqContext` per vLLM request context.

vLLM passes its own ``ReqContext`` (the same object for every call of one request); our
policies, managers and tiers keep per-request state on ours. The first call for a request
attaches ours to vLLM's (vLLM's ``set_state`` keys scratch state by type), so every later call,
from any plug-in, gets the same object.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvoffload.manager_contract import ReqContext

__all__ = ["kvoffload_context"]


class _VllmReqContext(Protocol):
    req_id: str
    kv_transfer_params: dict[str, Any] | None

    def get_state(self, cls: type) -> Any: ...

    def set_state(self, val: Any) -> None: ...


def kvoffload_context(vllm_ctx: _VllmReqContext) -> ReqContext:
    """Our context for ``vllm_ctx``, created on first use (duck-typed: no vLLM import). It shares
    vLLM's key positions (the same dict, which vLLM's scheduler fills as the request grows)."""
    ctx = vllm_ctx.get_state(ReqContext)
    if ctx is None:
        positions = getattr(vllm_ctx, "_offload_key_positions", None)
        ctx = ReqContext(
            vllm_ctx.req_id,
            dict(vllm_ctx.kv_transfer_params or {}),
            positions if isinstance(positions, dict) else {},
        )
        vllm_ctx.set_state(ctx)
    return ctx
