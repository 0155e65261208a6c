"""Operator controls of one engine: lookup, pin / unpin, clear, warm, pins.

:class:`EngineAdmin` answers on the thread that owns the engine (the serving loop's engine
thread, or the caller's for a bare :class:`~kvoffload.engine.Engine`), between steps:

* :meth:`~EngineAdmin.lookup`: how many leading tokens of a prompt each tier holds (``device``,
  ``host``, ``disk``, ``remote``) and how many a request would be served from cache
  (``cached_tokens``: the leading blocks held by some tier). A remote tier is asked (one
  pipelined round trip, within its own answer bound); keys it could not answer in time count
  as not held and the answer says ``"complete": false``.
* :meth:`~EngineAdmin.pin` / :meth:`~EngineAdmin.unpin` / :meth:`~EngineAdmin.pins`: operator
  pins (:mod:`kvoffload.managers.pins`) on the host tier and the disk tier, each bounded by a
  quota of ``kv_pin_quota`` of the tier's capacity. Disk pins are written to
  ``pins.json`` in the disk namespace (:mod:`kvoffload.tiers.disk.pins`) and held again at the
  next start. The remote tier takes no pins: the server evicts by its own ``maxmemory`` policy
  (docs/admin.md says what the server allows).
* :meth:`~EngineAdmin.clear`: remove the blocks of a tier (or all tiers) of this engine's model,
  or of another model's fingerprint namespace (disk, remote); pinned blocks stay unless
  ``unpin``; blocks being read or written stay. Every removed block is announced in the KV
  events (``BlockRemoved`` with its tier) and counted (``cleared_blocks``).
* Warming (compute a prompt's KV into the tiers named; promote it from disk or remote into the
  host) is a prefill-only request: :meth:`~EngineAdmin.warm_request` gives its token ids and
  transfer parameters, :meth:`~kvoffload.engine.Engine.warm` runs it on a bare engine, the
  server runs it as one of its requests.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvoffload.engine.sampling import SamplingParams
from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.events.messages import (
    LOCALITY_REMOTE,
    MEDIUM_STORAGE,
    BlockRemoved,
    KVEventBatch,
    external_block_hash,
)
from kvoffload.keys import OffloadKey, make_offload_key, offload_key_hash
from kvoffload.managers.admin import TierAdmin, leading
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.pins import Pin, PinTable
from kvoffload.tiers.contract import SecondaryTier

if TYPE_CHECKING:
    from kvoffload.engine.engine import Engine

__all__ = ["TIER_NAMES", "AdminPrompt", "EngineAdmin", "RemoteClear"]

#: Every tier an operator may name, fastest first.
TIER_NAMES = ("device", "host", "disk", "remote")


@dataclass(frozen=True, slots=True)
class RemoteClear:
    """The remote server's part of a clear: remove every key under ``prefix``. Holds no engine
    state, so :meth:`run` may run on any thread (it opens its own connection); ``own``: the
    keys are this engine's model's (its remote tier forgets what it knew; removals announced)."""

    url: str
    prefix: bytes
    own: bool

    def run(self) -> list[bytes]:
        """``SCAN`` + ``UNLINK`` the keys; the removed ones, without the prefix. Raises
        ``OSError`` when the server cannot be reached."""
        from kvoffload.tiers.redis.clear import drop_prefix

        return drop_prefix(self.url, self.prefix)


@dataclass(frozen=True, slots=True)
class AdminPrompt:
    """A prompt as the tiers see it: its token ids, device block hashes, offloaded block keys."""

    token_ids: list[int]
    device_hashes: list[bytes]
    keys: list[OffloadKey]
    block_tokens: int  # tokens per offloaded block


def check_tiers(tiers: Any, known: Sequence[str], param: str = "tiers") -> list[str]:
    """``tiers`` (a list of names, or one comma-separated string) checked against ``known``."""
    if isinstance(tiers, str):
        tiers = [t.strip() for t in tiers.split(",") if t.strip()]
    if not isinstance(tiers, list | tuple) or not all(isinstance(t, str) for t in tiers):
        raise ConfigError(param, f"must be a list of tier names, got {tiers!r}")
    unknown = [t for t in tiers if t not in known]
    if unknown or not tiers:
        raise ConfigError(
            param, f"unknown or missing tier {unknown or tiers!r}; this server has {list(known)}"
        )
    return list(dict.fromkeys(tiers))


class EngineAdmin:
    """Operator controls over ``engine`` (see the module docstring). Not thread-safe: call it
    from the thread that steps the engine."""

    def __init__(self, engine: Engine, pin_quota: float = 0.5) -> None:
        if not 0 <= pin_quota <= 1:
            raise ConfigError("kv_pin_quota", f"must be in [0, 1], got {pin_quota!r}")
        self.engine = engine
        #: the manager-level controls (``None`` without offloading: the device tier only)
        self.stack = TierAdmin(engine.manager, pin_quota) if engine.manager is not None else None
        stack = self.stack
        self.host: CPUOffloadingManager | None = stack.host if stack is not None else None
        self.secondary: dict[str, SecondaryTier] = stack.secondary if stack is not None else {}
        self.tiers = ["device", *(stack.tiers if stack is not None else [])]
        self.pin_table = stack.pins if stack is not None else PinTable({}, {})
        sites = self.pin_table.sites
        disk = self.secondary.get("disk")
        #: Blocks removed by clears, per tier (``kvoffload_admin_cleared_blocks_total``).
        self.cleared: Counter[str] = Counter()
        self._pin_file = None
        if "disk" in sites:
            from kvoffload.tiers.disk.pins import DiskPinFile

            self._pin_file = DiskPinFile(disk.namespace)  # type: ignore[union-attr]
            self._restore_disk_pins()

    # ------------------------------------------------------------------ prompts

    @property
    def model(self) -> str | None:
        """This engine's fingerprint namespace in shared tiers (hex), or ``None`` without one."""
        for tier in self.secondary.values():
            return tier.layout.fingerprint().hex()
        return None

    def prompt(self, prompt: str | Sequence[int]) -> AdminPrompt:
        """Tokenize ``prompt`` as the engine's requests are, and name its blocks."""
        engine = self.engine
        ids = engine.tokenize(prompt)
        config = engine.config
        hashes = engine.hasher.hash_blocks(ids)
        factor = config.block_size_factor
        keys = [make_offload_key(hashes[(i + 1) * factor - 1], 0)
                for i in range(len(hashes) // factor)]
        return AdminPrompt(ids, list(hashes), keys, config.block_size * factor)

    # ------------------------------------------------------------------ lookup

    def lookup(self, prompt: str | Sequence[int]) -> dict[str, Any]:
        """Leading tokens of ``prompt`` per tier, and how many a request would find cached."""
        p = self.prompt(prompt)
        bs = self.engine.config.block_size
        factor = self.engine.config.block_size_factor
        pool = self.engine.pool
        device = 0
        for h in p.device_hashes:
            if not pool.is_cached(h):  # type: ignore[arg-type]
                break
            device += 1
        held, complete = self.stack.held(p.keys) if self.stack is not None else ({}, True)
        tokens = {"device": device * bs}
        for name, hits in held.items():
            tokens[name] = leading(hits) * p.block_tokens
        cached = 0  # offloaded blocks held by the device (all its engine blocks) or some tier
        for i in range(len(p.keys)):
            on_device = (i + 1) * factor <= device
            if not on_device and not any(hits[i] for hits in held.values()):
                break
            cached += 1
        return {
            "prompt_tokens": len(p.token_ids),
            "block_tokens": p.block_tokens,
            "tiers": tokens,
            "cached_tokens": max(cached * p.block_tokens, device * bs),
            "pinned_tokens": {
                tier: leading([k in pinned for k in p.keys]) * p.block_tokens
                for tier in self.pin_table.sites
                if (pinned := self.pin_table.pinned_keys(tier)) is not None
            },
            "complete": complete,
            "model": self.model,
        }

    # ------------------------------------------------------------------ pins

    def pin(
        self,
        prompt: str | Sequence[int],
        tiers: Sequence[str] | str = ("host",),
        owner: str = "operator",
        ttl_s: float | None = None,
    ) -> dict[str, Any]:
        """Pin the prompt's blocks (all of them, in every tier named) for ``owner``; raises
        :class:`~kvoffload.managers.pins.NotCached` when a block is not ready in a tier (warm
        it first: :meth:`~kvoffload.engine.Engine.pin` does), and
        :class:`~kvoffload.managers.pins.PinQuotaExceeded` beyond a tier's quota."""
        names = check_tiers(tiers, list(self.pin_table.sites) or ["host"])
        p = self.prompt(prompt)
        pin = self.pin_table.pin(owner, p.keys, names, len(p.keys) * p.block_tokens, ttl_s)
        self._save_disk_pins()
        return pin.describe()

    def unpin(
        self,
        prompt: str | Sequence[int] | None = None,
        owner: str | None = None,
        pin_id: str | None = None,
    ) -> dict[str, Any]:
        """Remove the pins matching every criterion given; their blocks go back to eviction."""
        keys = self.prompt(prompt).keys if prompt is not None else None
        if prompt is not None and not keys:
            raise ConfigError("prompt", "holds no full block: it matches no pin")
        gone = self.pin_table.unpin(pin_id, owner, keys)
        self._save_disk_pins()
        return {"unpinned": [pin.describe() for pin in gone]}

    def pins(self) -> dict[str, Any]:
        """The live pins, and per tier the blocks pinned and the quota."""
        self.expire()
        table = self.pin_table
        return {
            "pins": [pin.describe() for pin in table.pins()],
            "quota_blocks": dict(table.quotas),
            "pinned_blocks": {tier: table.pinned_blocks(tier) for tier in table.sites},
        }

    def expire(self) -> list[Pin]:
        """Drop pins whose TTL passed (O(1) when none is due; the engine calls it every step)."""
        gone = self.pin_table.expire()
        if gone:
            self._save_disk_pins()
        return gone

    def _save_disk_pins(self) -> None:
        if self._pin_file is not None:
            self._pin_file.save([p for p in self.pin_table.pins() if "disk" in p.tiers])

    def _restore_disk_pins(self) -> None:
        """Hold again the disk pins of an earlier run (blocks found on disk at start), each on
        the disk only; a pin whose blocks are gone, or that would pass the quota, is dropped."""
        if self._pin_file is None:
            return
        now = time.time()
        for saved in self._pin_file.load():
            ttl = None if saved.expires_at is None else saved.expires_at - now
            if ttl is not None and ttl <= 0:
                continue
            try:
                self.pin_table.pin(saved.owner, saved.keys, ["disk"], saved.num_tokens, ttl)
            except KVOffloadError as exc:  # gone, or past a quota lowered since
                self._pin_file.dropped.append(f"{saved.owner}: {exc}")
        self._save_disk_pins()

    # ------------------------------------------------------------------ clear

    def clear(
        self, tiers: Sequence[str] | str | None = None, model: str | None = None, unpin: bool = False
    ) -> dict[str, Any]:
        """Remove blocks: of the tiers named (all by default), of this engine's model, or of
        the fingerprint namespace ``model`` (hex) in the shared tiers. Pinned blocks stay unless
        ``unpin`` (which drops the pins of those tiers first); blocks being read or written
        stay. Returns the blocks removed per tier (and what was kept).

        The remote server's ``SCAN`` + ``UNLINK`` runs on the calling thread here; a server
        runs :meth:`clear_local`, then :meth:`RemoteClear.run` off the engine thread, then
        :meth:`finish_clear`, so engine steps go on during it."""
        answer, remote = self.clear_local(tiers, model, unpin)
        if remote is None:
            return answer
        try:
            keys = remote.run()
        except BaseException:
            self.finish_clear(answer, remote, None)
            raise
        return self.finish_clear(answer, remote, keys)

    def clear_local(
        self, tiers: Sequence[str] | str | None = None, model: str | None = None, unpin: bool = False
    ) -> tuple[dict[str, Any], RemoteClear | None]:
        """The part of :meth:`clear` on this engine's own tiers (and another model's disk
        namespace); returns the answer so far and the remote server's clear still to run (then
        :meth:`finish_clear`), or ``None``."""
        names = check_tiers(tiers, self.tiers) if tiers is not None else list(self.tiers)
        own = model is None or model == self.model
        if not own:
            return self._clear_other_model(names, _check_fingerprint(model))
        removed: dict[str, int] = {}
        unpinned: list[Pin] = []
        if unpin:
            for name in names:
                if name in self.pin_table.sites:
                    unpinned += self.pin_table.unpin_tier(name)
            self._save_disk_pins()
        engine = self.engine
        if "device" in names:
            removed["device"] = engine.pool.drop_cached()
        if self.stack is not None:
            removed.update(self.stack.drop_evictable(names))
        remote_clear: RemoteClear | None = None
        remote = self.secondary.get("remote")
        if "remote" in names and remote is not None:
            remote_clear = self._remote_clear(remote)
            if remote_clear is None:
                removed["remote"] = 0
        self.cleared.update(removed)
        engine.publish_events()
        kept = {t: self.pin_table.pinned_blocks(t) for t in names if t in self.pin_table.sites}
        return ({"removed_blocks": removed, "kept_pinned_blocks": kept,
                 "unpinned": [p.describe() for p in unpinned], "model": self.model},
                remote_clear)

    def _remote_clear(self, tier: SecondaryTier) -> RemoteClear | None:
        """The clear of this model's keys on the remote server (``None``: no server)."""
        from kvoffload.tiers.redis.config import remote_key_prefix
        from kvoffload.tiers.redis.url import parse_redis_url

        url = self.engine.config.kv_remote_url
        if url is None:
            return None
        tier.drain_jobs()
        return RemoteClear(url, remote_key_prefix(tier.layout, parse_redis_url(url).namespace),
                           own=True)

    def finish_clear(
        self, answer: dict[str, Any], remote: RemoteClear, keys: list[bytes] | None
    ) -> dict[str, Any]:
        """Complete :meth:`clear_local`'s ``answer`` with ``remote``'s removed ``keys`` (``None``:
        it failed): the remote tier forgets what it knew of the server's keys, this model's
        removed blocks are announced, all are counted."""
        tier = self.secondary.get("remote")
        if remote.own and tier is not None:
            tier.drain_jobs()
            tier.reset()  # what it knew of the server's keys is stale now
        if keys is None:
            return answer
        answer["removed_blocks"]["remote"] = len(keys)
        self.cleared.update({"remote": len(keys)})
        if remote.own and keys:
            self._announce_remote([OffloadKey(k) for k in keys])
        return answer

    def _announce_remote(self, keys: list[OffloadKey]) -> None:
        """``BlockRemoved`` (remote) for blocks a clear took from the shared server (the tier
        itself announces only the blocks it evicts)."""
        as_int = self.engine.config.events.int_block_hashes
        by_group: dict[int, list[bytes | int]] = {}
        for key in keys:
            group = int.from_bytes(key[-4:], "big")
            by_group.setdefault(group, []).append(
                external_block_hash(offload_key_hash(key), as_int)
            )
        events = [BlockRemoved(hashes, MEDIUM_STORAGE, group, LOCALITY_REMOTE)
                  for group, hashes in by_group.items()]
        publisher = self.engine.publisher
        if self.engine.config.events.enable_kv_cache_events:
            publisher.publish(KVEventBatch(time.time(), list(events)))

    def _clear_other_model(
        self, names: list[str], fingerprint: str
    ) -> tuple[dict[str, Any], RemoteClear | None]:
        """Remove another model's blocks from the shared tiers: its disk namespace (when no
        live process uses it) and (returned, to run) its keys on the remote server."""
        removed: dict[str, int] = {}
        refused: dict[str, str] = {}
        disk = self.secondary.get("disk")
        if "disk" in names and disk is not None:
            from kvoffload.tiers.disk.reclaim import remove_unused_namespace

            namespace = disk.namespace.parent / fingerprint  # type: ignore[attr-defined]
            files = remove_unused_namespace(namespace) if namespace.exists() else 0
            if files is None:
                refused["disk"] = "a live process uses that namespace: clear it on that server"
            else:
                removed["disk"] = files
        remote = self.secondary.get("remote")
        url = self.engine.config.kv_remote_url
        remote_clear: RemoteClear | None = None
        if "remote" in names and remote is not None and url is not None:
            from kvoffload.tiers.redis.url import parse_redis_url

            space = parse_redis_url(url).namespace
            prefix = b"kvo:" + (space.encode() + b":" if space else b"") + fingerprint.encode() + b":"
            remote_clear = RemoteClear(url, prefix, own=False)
        self.cleared.update(removed)
        return ({"removed_blocks": removed, "refused": refused, "model": fingerprint,
                 "kept_pinned_blocks": {}, "unpinned": []}, remote_clear)

    # ------------------------------------------------------------------ warm

    def warm_request(
        self, prompt: str | Sequence[int], tiers: Sequence[str] | str | None = None
    ) -> tuple[list[int], SamplingParams, dict[str, Any]]:
        """The prefill-only request that warms ``prompt``: its token ids, sampling (one token)
        and transfer parameters (stores cascade to the secondary tiers named; every store goes
        through the host; a prefix held on disk or remote is promoted into the host on the
        way). ``tiers`` default: every tier."""
        names = check_tiers(tiers, self.tiers) if tiers is not None else list(self.tiers)
        ids = self.engine.tokenize(prompt)
        params: dict[str, Any] = {}
        if self.secondary:
            params["kv_store_tiers"] = [t for t in names if t in self.secondary]
        return ids, SamplingParams(max_tokens=1), params


    def warmed(self, prompt: str | Sequence[int], tiers: Sequence[str] | str | None = None) -> bool:
        """Whether every full block of ``prompt`` is ready in the host tier and held by each
        secondary tier of ``tiers`` (default: all) as far as that tier knows without asking its
        server: what a warm-up waits for, rather than for every transfer of the engine."""
        names = check_tiers(tiers, self.tiers) if tiers is not None else list(self.tiers)
        keys = self.prompt(prompt).keys
        return self.stack is None or self.stack.ready_in(keys, names)


def _check_fingerprint(model: Any) -> str:
    if not isinstance(model, str) or len(model) != 32 or any(c not in "0123456789abcdef" for c in model):
        raise ConfigError("model", f"must be a layout fingerprint (32 hex digits), got {model!r}")
    return model
