"""The configurations ``bench serve --compare-routing`` compares: a router's flags per policy,
and one instance with N times the caches (no router)."""

from __future__ import annotations

__all__ = ["CONFIG_NAMES", "NX_CACHE", "ROUTER_CONFIGS"]

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
