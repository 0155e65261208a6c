"""A request's offloading parameters (``kv_transfer_params``): which keys the connector reads,
and their validation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvoffload.errors import ConfigError
from kvoffload.scheduler.policy import STORE_POLICIES

__all__ = ["KV_TRANSFER_PARAMS", "parse_kv_transfer_params"]

#: The ``kv_transfer_params`` keys the connector reads, and the type of each value.
KV_TRANSFER_PARAMS: dict[str, type] = {
    "store_policy": str,
    "max_offload_tokens": int,
    "max_load_tokens": int,
}


def parse_kv_transfer_params(
    params: Mapping[str, Any] | None, default_policy: str
) -> tuple[str, int | None, int | None]:
    """Validate a request's offloading parameters: ``(store_policy, max_offload_tokens, max_load_tokens)``.

    Recognised keys: ``store_policy`` (a name from ``STORE_POLICIES``), ``max_offload_tokens``
    (store at most the request's first that many tokens) and ``max_load_tokens`` (load at most
    that many tokens beyond the engine's own prefix-cache hit); non-negative ints.
    Other keys are left for other components. Bad values raise :class:`ConfigError`.
    """
    if params is None:
        return default_policy, None, None
    if not isinstance(params, Mapping):
        raise ConfigError("kv_transfer_params", f"must be a dict or None, got {params!r}")
    policy = params.get("store_policy", default_policy)
    # Not a str (a JSON list, say) would be unhashable: a TypeError instead of a ConfigError.
    if not isinstance(policy, str) or policy not in STORE_POLICIES:
        raise ConfigError(
            "kv_transfer_params.store_policy",
            f"unknown store policy {policy!r}; choose from {sorted(STORE_POLICIES)}",
        )
    caps: list[int | None] = []
    for name in (k for k, kind in KV_TRANSFER_PARAMS.items() if kind is int):
        value = params.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ConfigError(
                f"kv_transfer_params.{name}", f"must be a non-negative integer, got {value!r}"
            )
        caps.append(value)
    return policy, caps[0], caps[1]
