"""The configurations ``bench serve --compare-routing`` compares: a router's flags per policy,
and one instance with N times the caches (no router)."""

from __future__ import annotations

__all__ = ["CONFIG_NAMES", "NX_CACHE", "ROUTER_CONFIGS", "repeat_order"]

#: Name -> the router's flags.
ROUTER_CONFIGS: dict[str, tuple[str, ...]] = {
    "round_robin": ("--policy", "round_robin"),
    "least_load": ("--policy", "least_load"),
    "kv_aware": ("--policy", "kv_aware"),
    "kv_aware_tier_blind": ("--policy", "kv_aware", "--tier-weights", "blind"),
    "kv_aware_dynamo_credits": ("--policy", "kv_aware", "--tier-weights", "dynamo"),
}
#: One instance with N times each instance's device, host and disk caches.
NX_CACHE = "one_instance_Nx_cache"
CONFIG_NAMES: tuple[str, ...] = (*ROUTER_CONFIGS, NX_CACHE)


def repeat_order(configs: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """The order of ``configs`` in repeat ``repeat`` (0-based): rotated by one each repeat, so over
    ``len(configs)`` repeats every configuration runs once in every position and none always runs
    first (the machine's load drifts during a comparison; a fixed order hands the drift to one)."""
    shift = repeat % len(configs) if configs else 0
    return (*configs[shift:], *configs[:shift])
