"""The one line ``kvoffload serve`` prints once it answers requests: where, which model, which
tiers (with their sizes) and where its KV events are published. Never a credential: a remote
tier is shown by :func:`~kvoffload.tiers.redis.url.redacted_url`."""

from __future__ import annotations

from kvoffload.engine import Engine
from kvoffload.tiers.redis.url import redacted_url

__all__ = ["ready_line"]


def ready_line(engine: Engine, url: str, model_name: str, sources: dict[str, dict[str, str]]) -> str:
    """``kvoffload serve: ready at URL: model NAME (MODEL); tiers: ...; KV events ...``;
    ``sources``: the ``/kv_event_sources`` answer (empty: events off)."""
    config = engine.config
    model = model_name if model_name == config.model else f"{model_name} ({config.model})"
    tiers = [f"device {engine.num_device_blocks} blocks of {config.block_size} tokens"]
    if engine.worker is not None:
        tiers.append(f"host {config.kv_offloading_size:g} GiB ({engine.worker.num_host_blocks} "
                     f"blocks)")
    names = engine.tiering.tier_names if engine.tiering is not None else ()
    if "disk" in names:
        tiers.append(f"disk {config.kv_disk_size:g} GiB in {config.kv_disk_path}")
    if "remote" in names and config.kv_remote_url is not None:
        tiers.append(f"remote {redacted_url(config.kv_remote_url)}")
    elif config.kv_remote_url is not None:
        tiers.append("remote down at start: running without it")
    endpoints = [s.get("endpoint") for s in sources.values()]
    events = f"KV events at {', '.join(map(str, endpoints))}" if endpoints else "KV events off"
    return f"kvoffload serve: ready at {url}: model {model}; tiers: {', '.join(tiers)}; {events}"
