"""The engine and tier flags: one table, :data:`ENGINE_FLAGS`, for every command that builds an
engine (``bench throughput``, ``serve``).

``add_engine_flags(parser)`` adds them (a command may override defaults, or leave flags out);
``engine_config_from_args(args)`` applies their rules and builds the :class:`EngineConfig`. Each
flag is one row: the setting it sets (an ``EngineConfig`` field), its type and range, its default
(``EngineConfig``'s own unless a command overrides it), its unit, its help, and the tier it needs:
a tier flag given without its tier (``--kv-disk-size`` without ``--kv-disk-path``) is refused
naming both, never silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from kvoffload.cli.args import int_in, real_in
from kvoffload.cli.flagspec import Flag, Needs, add_flags, help_section, resolve_flags
from kvoffload.engine.config import OFFLOADING_BACKENDS, EngineConfig
from kvoffload.engine.setting_choices import SCHEDULING_POLICIES
from kvoffload.errors import ConfigError

__all__ = [
    "ENGINE_FLAGS",
    "TIER_SETTINGS",
    "add_engine_flags",
    "engine_config_from_args",
    "engine_kwargs_from_args",
]


def _policies() -> list[str]:
    from kvoffload.eviction import available_eviction_policies

    return available_eviction_policies()


def _store_policies() -> list[str]:
    from kvoffload.scheduler import STORE_POLICIES

    return sorted(STORE_POLICIES)


def _load_policies() -> tuple[str, ...]:
    from kvoffload.scheduler.costs import LOAD_POLICIES

    return LOAD_POLICIES


def _cascade_modes() -> tuple[str, ...]:
    from kvoffload.managers.tiering import CASCADE_MODES

    return CASCADE_MODES


# What a flag needs is read from the resolved flags; a flag a command leaves out is absent.
def _compression_modes() -> tuple[str, ...]:
    from kvoffload.tiers.codec import COMPRESSION_CHOICES

    return COMPRESSION_CHOICES


def _has_disk(flags: argparse.Namespace, provided: Collection[str]) -> bool:
    return "disk" in provided or getattr(flags, "kv_disk_path", None) is not None


def _has_remote(flags: argparse.Namespace, provided: Collection[str]) -> bool:
    return "remote" in provided or getattr(flags, "kv_remote_url", None) is not None


HOST = Needs(
    "the host tier (--kv-offloading-size > 0)",
    lambda f, _: getattr(f, "kv_offloading_size", 0) > 0,
)
DISK = Needs("--kv-disk-path", _has_disk)
REMOTE = Needs("--kv-remote-url", _has_remote)
SECONDARY = Needs(
    "a disk or remote tier (--kv-disk-path, --kv-remote-url)",
    lambda f, p: _has_disk(f, p) or _has_remote(f, p),
)
METRICS = Needs("--metrics-port", lambda f, _: getattr(f, "metrics_port", None) is not None)
CACHE_AWARE = Needs(
    "--scheduling-policy cache_aware",
    lambda f, _: getattr(f, "scheduling_policy", None) == "cache_aware",
)

_CONFIG_DEFAULTS = {
    f.name: f.default
    for f in dataclasses.fields(EngineConfig)
    if f.init and f.default not in (None, dataclasses.MISSING)
}


def _engine_flag(dest: str, help: str, **rule: Any) -> Flag:
    """A row whose default is ``EngineConfig``'s (unless the row says otherwise)."""
    rule.setdefault("default", _CONFIG_DEFAULTS.get(dest))
    return Flag(dest, help, **rule)


ENGINE_FLAGS: tuple[Flag, ...] = (
    _engine_flag(
        "model", "a preset (tiny, small) or a local Hugging Face checkpoint directory", unit="MODEL"
    ),
    _engine_flag("device", "torch device (cpu, cuda, cuda:N)", unit="DEVICE"),
    _engine_flag(
        "dtype",
        "model and KV cache dtype",
        choices=("float32", "bfloat16", "float16"),
        unset="float32 on CPU, bfloat16 on CUDA",
    ),
    _engine_flag(
        "seed",
        "seed of the model's weights (and of bench's workloads)",
        parse=int_in(0, 2**64 - 1),
        unit="N",
    ),
    _engine_flag(
        "num_device_blocks",
        "device KV cache size in blocks (instead of --kv-cache-memory)",
        parse=int_in(1),
        unit="BLOCKS",
        group="device_cache",
        unset="as many as --kv-cache-memory holds",
    ),
    _engine_flag(
        "kv_cache_memory",
        "device KV cache size (instead of --num-device-blocks)",
        parse=real_in(0, positive=True),
        unit="GiB",
        group="device_cache",
        unset="--num-device-blocks",
    ),
    _engine_flag("block_size", "tokens per engine KV block", parse=int_in(1), unit="TOKENS"),
    _engine_flag(
        "max_num_batched_tokens", "tokens per engine step", parse=int_in(1), unit="TOKENS"
    ),
    _engine_flag("max_num_seqs", "requests per engine step", parse=int_in(1), unit="N"),
    _engine_flag(
        "scheduling_policy",
        "order of admission: fcfs, or cache_aware (longest device-resident prefix first, then the "
        "held prefix worth loading, aged; bounded bypass)",
        choices=SCHEDULING_POLICIES,
    ),
    _engine_flag(
        "scheduling_max_bypass",
        "cache_aware: most later arrivals admitted before a waiting request",
        parse=int_in(0),
        unit="N",
        needs=CACHE_AWARE,
    ),
    _engine_flag("enable_prefix_caching", "the engine's own device prefix cache", kind="negatable"),
    _engine_flag(
        "kv_offloading_size",
        "host-memory tier size, 0 = no offloading",
        parse=real_in(0),
        unit="GiB",
    ),
    _engine_flag(
        "kv_offloading_backend", "offloading backend", choices=OFFLOADING_BACKENDS, needs=HOST
    ),
    _engine_flag(
        "block_size_factor",
        "engine blocks per offloaded block",
        parse=int_in(1),
        unit="N",
        needs=HOST,
    ),
    _engine_flag(
        "eviction_policy", "the host tier's eviction policy", choices=_policies, needs=HOST
    ),
    _engine_flag("store_policy", "when blocks are stored", choices=_store_policies, needs=HOST),
    _engine_flag(
        "load_policy",
        "which offloaded hits are loaded: auto (the prefix cheaper to load than to compute, by "
        "measured costs), always, never (stores still happen)",
        choices=_load_policies,
        needs=HOST,
    ),
    _engine_flag(
        "store_threshold",
        "store a block once this many requests wanted it (0 or 1 = always)",
        parse=int_in(0),
        unit="N",
        needs=HOST,
    ),
    _engine_flag(
        "kv_disk_path",
        "a disk tier behind the host tier, in this directory (kept: a later run starts warm "
        "from it)",
        unit="DIR",
        needs=HOST,
        unset="no disk tier",
    ),
    _engine_flag(
        "kv_disk_size",
        "the disk tier's size",
        parse=real_in(0, positive=True),
        unit="GiB",
        needs=DISK,
        default=None,
        unset="none: required with --kv-disk-path",
    ),
    _engine_flag(
        "kv_disk_eviction_policy",
        "the disk tier's eviction policy",
        choices=_policies,
        needs=DISK,
        unset="--eviction-policy",
    ),
    _engine_flag(
        "kv_disk_compression",
        "the disk tier's block codec: lossless (exact, fewer bytes), auto (lossless when it "
        "pays), fp8 (lossy, about half the bytes; its blocks never serve exact tiers)",
        choices=_compression_modes,
        needs=DISK,
    ),
    _engine_flag(
        "kv_tier_cascade",
        "when host blocks are copied to the disk and remote tiers",
        choices=_cascade_modes,
        needs=SECONDARY,
    ),
    _engine_flag(
        "kv_store_max_in_flight",
        "once earlier steps' stores to the host still in flight hold this many blocks, new "
        "stores are shed (not offloaded) instead of queued",
        parse=int_in(0),
        unit="BLOCKS",
        needs=HOST,
        unset="half the host tier",
    ),
    _engine_flag(
        "kv_tier_write_max_in_flight",
        "blocks being written to each disk or remote tier at once; the rest wait unpinned "
        "and are shed if the host evicts them first (0 writes nothing)",
        parse=int_in(0),
        unit="BLOCKS",
        needs=SECONDARY,
        unset="half the host tier",
    ),
    _engine_flag(
        "kv_tier_write_min_reuse",
        "write a block to the disk and remote tiers only once this many requests saw it "
        "(1 = every block)",
        parse=int_in(1),
        unit="N",
        needs=SECONDARY,
    ),
    _engine_flag(
        "kv_promotion_wait_s",
        "how long a lookup may wait for its blocks' promotion from a disk or remote tier, so "
        "that the hit loads in the same step (0 = answer at once, load a step later)",
        parse=real_in(0),
        unit="SECONDS",
        needs=SECONDARY,
    ),
    _engine_flag(
        "kv_lookup_retry_s",
        "how long a request waits for its blocks' promotion from a disk or remote tier before "
        "computing them",
        parse=real_in(0),
        unit="SECONDS",
        needs=SECONDARY,
        aliases=("--kv-lookup-retry-seconds",),
    ),
    _engine_flag(
        "kv_remote_url",
        "a shared Redis / Valkey tier: redis://[:PASSWORD@]HOST:PORT/DB, rediss://..., "
        "redis+cluster://HOST:PORT,HOST:PORT (password also from KVOFFLOAD_REMOTE_PASSWORD)",
        unit="URL",
        needs=HOST,
        unset="no remote tier",
    ),
    _engine_flag(
        "kv_remote_optional",
        "run without the remote tier when its server is down at start",
        kind="switch",
        needs=REMOTE,
    ),
    _engine_flag(
        "kv_remote_ttl_s",
        "time until the server expires a block",
        parse=real_in(0, positive=True),
        unit="SECONDS",
        needs=REMOTE,
        aliases=("--kv-remote-ttl",),
        unset="never",
    ),
    _engine_flag(
        "kv_remote_lookup_wait_s",
        "how long a block's remote lookup may take before it counts as a miss for now",
        parse=real_in(0, positive=True),
        unit="SECONDS",
        needs=REMOTE,
        aliases=("--kv-remote-lookup-wait",),
    ),
    _engine_flag(
        "kv_remote_compression",
        "the remote tier's block codec (as --kv-disk-compression)",
        choices=_compression_modes,
        needs=REMOTE,
    ),
    _engine_flag(
        "kv_pin_quota",
        "the share of each tier (host, disk) that operator pins may hold (kvoffload admin pin)",
        parse=real_in(0, below=1.0),
        unit="FRACTION",
        needs=HOST,
    ),
    _engine_flag(
        "kv_events_config",
        'KV cache events, as JSON: {"enable_kv_cache_events": true, "publisher": "zmq", ...}',
        unit="JSON",
        unset="off",
    ),
    _engine_flag(
        "metrics_port",
        "serve Prometheus /metrics on this port, 0 = any free port",
        parse=int_in(0, 65535),
        unit="PORT",
        unset="off",
    ),
    _engine_flag("metrics_host", "address /metrics listens on", unit="HOST", needs=METRICS),
    _engine_flag(
        "log_stats_interval_s",
        "log an engine stats line every this many seconds, 0 = off",
        parse=real_in(0),
        unit="SECONDS",
        aliases=("--log-stats-interval",),
    ),
)

#: The settings that configure one secondary tier only (a run without the tier leaves them out).
TIER_SETTINGS: dict[str, tuple[str, ...]] = {
    "disk": tuple(f.dest for f in ENGINE_FLAGS if f.needs is DISK or f.dest == "kv_disk_path"),
    "remote": tuple(f.dest for f in ENGINE_FLAGS if f.needs is REMOTE or f.dest == "kv_remote_url"),
}


def add_engine_flags(
    parser: argparse.ArgumentParser,
    *,
    defaults: Mapping[str, Any] | None = None,
    exclude: Collection[str] = (),
) -> None:
    """Add every engine and tier flag to ``parser``. ``defaults`` (setting -> value) replaces
    ``EngineConfig``'s defaults for this command; ``exclude`` leaves settings out."""
    for title in _ORDER:  # the headings in this order (argparse hides an empty one)
        help_section(parser, title)
    table = tuple(map(_sectioned, ENGINE_FLAGS))
    add_flags(parser, table, defaults, exclude)


#: ``--help``'s sections of the engine flags: a row's own ``section=`` wins; else this map; else
#: the tier it needs names it (a new ``needs=DISK`` flag is listed under "disk tier" with no
#: change here); else "engine". Listed in the order of :data:`_ORDER`.
_NEEDS_SECTIONS = {HOST: "host tier", DISK: "disk tier", REMOTE: "remote tier",
                   SECONDARY: "disk and remote tiers", METRICS: "metrics and logs"}
_ORDER = ("engine", "host tier", "disk tier", "remote tier", "disk and remote tiers", "events",
          "metrics and logs")
_SECTIONS = {
    "kv_offloading_size": "host tier",
    "kv_disk_path": "disk tier",
    "kv_remote_url": "remote tier",
    "kv_events_config": "events",
    "metrics_port": "metrics and logs",
    "log_stats_interval_s": "metrics and logs",
}


def _sectioned(flag: Flag) -> Flag:
    """``flag`` with its ``--help`` section (see :data:`_SECTIONS`)."""
    if flag.section is not None:
        return flag
    by_needs = _NEEDS_SECTIONS.get(flag.needs) if flag.needs is not None else None
    return dataclasses.replace(flag, section=_SECTIONS.get(flag.dest, by_needs or "engine"))


def engine_kwargs_from_args(
    args: argparse.Namespace, provided: Collection[str] = ()
) -> dict[str, Any]:
    """``EngineConfig`` keyword arguments of the parsed flags (settings left at ``None`` are
    left out). Raises :class:`ConfigError` naming a flag given without its tier, or a disk path
    without its size. ``provided``: tiers the command supplies itself (``{"remote"}``)."""
    flags = resolve_flags(args, provided)
    if getattr(flags, "kv_disk_path", None) is not None and flags.kv_disk_size is None:
        raise ConfigError("kv_disk_size", "--kv-disk-path needs --kv-disk-size GiB")
    return {
        f.dest: getattr(flags, f.dest)
        for f in ENGINE_FLAGS
        if getattr(flags, f.dest, None) is not None
    }


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The :class:`EngineConfig` of the parsed flags; :class:`ConfigError` naming the setting
    when a flag is refused (without its tier) or the configuration is invalid."""
    return EngineConfig(**engine_kwargs_from_args(args))
