"""The disk tier: blocks as self-checking files in a directory, bounded, crash-safe and shareable.

See ``docs/disk-tier.md``. In short:

* **Bounded.** The namespace's block files (header + payload, in whole 4 KiB blocks) and its ledger
  never exceed ``capacity_bytes``. The byte count is shared by every process on the directory
  (:class:`~kvoffload.tiers.disk.ledger.SpaceLedger`); a writer reserves before it writes and
  evicts its own index's blocks (by the eviction policy) when the directory is full.
* **Crash-safe.** A file appears under its final name only complete (written under another
  name, then published by a rename or ``link`` that never replaces a file); every load checks the header (magic, version, layout fingerprint, key) and the xxh3
  checksum of the payload. A bad file fails its load (cause counted) and is deleted.
* **Warm restart.** The index is rebuilt from the file names at start (no file is read); with
  events on, the blocks found are announced once (``BlockStored``, medium ``STORAGE``), as are
  blocks the rescan finds.
* **Shareable.** Names are the deterministic block keys, so processes on one directory serve each
  other's blocks; a background rescan (every ``rescan_interval`` s, only directories whose mtime
  changed) learns of blocks other processes wrote. Eviction rule: any process may evict any block
  file it knows of (the shared bound is enforced by whoever writes); a reader that already opened
  a file keeps reading it intact after an unlink (POSIX), and one that opens too late gets
  ``ENOENT``: a failed load, a recompute, never wrong bytes.

* **Compressed** (``compression``, :mod:`kvoffload.tiers.codec`): blocks are encoded on the I/O
  threads and decoded there; files differ in size, so the namespace is one of its own and the
  ledger counts each file's measured bytes (more blocks in the same bound).

This module is the scheduler-thread side: the in-memory index and the decisions. The modules
beside it do the rest: ``diskjobs`` (the I/O threads), ``diskfiles`` (one block file),
``diskledger`` (the shared byte count), ``diskscan`` (finding files), ``diskdir`` (the directory).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload.errors import ConfigError
from kvoffload.eviction import EvictionPolicy, OffloadedBlock, create_eviction_policy
from kvoffload.eviction.base import PENDING
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import EventQueueMixin, LookupResult, OffloadingEvent, ReqContext
from kvoffload.tiers.codec import BlockCodec
from kvoffload.tiers.contract import KVLayout, SecondaryTier, TierJob, TierJobResult
from kvoffload.tiers.disk.directory import (
    check_o_direct,
    free_bytes,
    prepare_namespace,
    superseded_namespaces,
)
from kvoffload.tiers.disk.files import BlockFiles, FaultHook, file_bytes
from kvoffload.tiers.disk.jobs import DiskJobRunner, Items, RunningJob
from kvoffload.tiers.disk.ledger import MEASURE, SpaceLedger, measured_bytes
from kvoffload.tiers.disk.reclaim import OldNamespaces
from kvoffload.tiers.disk.scan import (
    NamespaceScanner,
    Rescanner,
    census_files,
    count_file_bytes,
    count_files,
)
from kvoffload.tiers.disk.spares import SparePool, remove_all

__all__ = ["LEDGER_BYTES", "DiskTier", "DiskTierSettings"]

logger = logging.getLogger(__name__)

_MISS, _HIT, _HIT_PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING
#: The ledger file's share of the bound.
LEDGER_BYTES = 4096
#: The smallest block file: its header page and one page of payload.
MIN_FILE = 8192
_DROP_CAUSES = frozenset(("missing", "checksum", "corrupt", "layout"))
_CAUSES = ("missing", "checksum", "corrupt", "layout", "io", "timeout", "full")
#: Empty files kept ready for writes (made while idle; see ``diskspares``).
SPARE_FILES = 64
#: Rescan ticks between two ledger reconciliations when nothing asked for one sooner.
RECONCILE_EVERY_TICKS = 30
_COUNTERS = (
    "filesystem_full_stores",
    "stored_blocks",
    "loaded_blocks",
    "evicted_blocks",
    "failed_load_blocks",
    "failed_store_blocks",
    "rejected_stores",
    "scanned_blocks",
    "discovered_blocks",
)


@dataclass(frozen=True, slots=True)
class DiskTierSettings:
    """How a :class:`DiskTier` is built.

    ``path``: the directory (created if missing); ``capacity_bytes``: the bound on disk, ledger
    included; ``eviction_policy``: a registry name or a policy; ``num_threads``: I/O threads;
    ``o_direct``: bypass the page cache (needs 4 KiB aligned pool and block size and a
    filesystem that supports it); ``rescan_interval``: seconds between looks for other
    processes' new files (0: never); ``fault_hook``: injects OS errors (tests);
    ``compression``: the tier's codec (``none`` by default).
    """

    path: str | os.PathLike[str]
    capacity_bytes: int
    eviction_policy: str | EvictionPolicy = "adaptive"
    num_threads: int = 4
    o_direct: bool = False
    rescan_interval: float = 2.0
    fault_hook: FaultHook | None = None
    #: ``kv_disk_compression``: ``none``, ``lossless``, ``auto`` or ``fp8`` (lossy; opt-in). A
    #: compressed tier keeps its files in a namespace of its own (``<fingerprint>.z``), each
    #: counted by its own size (:mod:`kvoffload.tiers.codec`).
    compression: str = "none"


class DiskTier(EventQueueMixin, SecondaryTier):
    """A :class:`SecondaryTier` on a local or shared filesystem (see the module docstring).

    Bad settings raise :class:`ConfigError` naming ``kv_disk_path`` / ``kv_disk_size`` /
    ``kv_disk_o_direct``. Index invariants: a key is ``PENDING`` while a store of this tier
    writes it, ready (``ref_cnt`` 0) or pinned by loads (``ref_cnt`` > 0) otherwise; the index
    never holds more than ``capacity_blocks`` keys.
    """

    name = "disk"
    locality = "LOCAL"

    def __init__(
        self,
        pool: memoryview,
        layout: KVLayout,
        settings: DiskTierSettings,
        enable_events: bool = False,
    ) -> None:
        super().__init__(pool, layout)
        self.settings = settings
        self.codec = codec = BlockCodec(settings.compression, layout, "kv_disk_compression")
        #: Files differ in size (a compressed tier): each is counted by its own bytes.
        self.sized = sized = codec.encodes
        if sized and settings.o_direct:
            raise ConfigError("kv_disk_compression", "compressed block files need O_DIRECT off")
        stored_layout = codec.stored_layout(layout)
        self.file_bytes = fb = file_bytes(layout.block_bytes)
        capacity_bytes = settings.capacity_bytes
        if not capacity_bytes >= LEDGER_BYTES + fb:  # also rejects NaN
            raise ConfigError(
                "kv_disk_size",
                f"{capacity_bytes!r} bytes do not hold one block file of {fb} bytes "
                f"(+{LEDGER_BYTES} for the ledger)",
            )
        self.capacity_bytes = int(capacity_bytes)
        # A compressed tier's index may hold as many blocks as the smallest files fit.
        self.capacity_blocks = (self.capacity_bytes - LEDGER_BYTES) // (MIN_FILE if sized else fb)
        #: Bytes of each indexed block's file (compressed tiers; an estimate for other
        #: processes' files until one is measured) and their sum.
        self._sizes: dict[OffloadKey, int] = {}
        self._stored_bytes = 0
        self.root = Path(settings.path)
        self.namespace = prepare_namespace(self.root, stored_layout, ".z" if sized else "")
        superseded = superseded_namespaces(self.namespace, layout)
        self._old_namespaces = OldNamespaces(self.root, superseded)
        self._old_namespaces.reclaim()
        flat = pool.cast("B") if pool.ndim != 1 else pool
        if settings.o_direct:
            check_o_direct(self.namespace, flat, layout.block_bytes)
        self._files = BlockFiles(
            self.namespace,
            stored_layout.fingerprint(),
            flat,
            layout.block_bytes,
            settings.o_direct,
            settings.fault_hook,
            codec if sized else None,
        )
        self._ledger = SpaceLedger(self.namespace / "ledger", self.capacity_bytes - LEDGER_BYTES)
        policy = settings.eviction_policy
        self._policy = (
            create_eviction_policy(policy, self.capacity_blocks)
            if isinstance(policy, str)
            else policy
        )
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._spares = SparePool(
            self.namespace,
            min(SPARE_FILES, self.capacity_blocks),
            settings.o_direct,
            self._ledger.owner,
        )
        self._runner = DiskJobRunner(
            self._files,
            self._ledger,
            fb,
            settings.num_threads,
            self._spares,
            codec if sized else None,
        )
        self._counters: dict[str, int] = collections.defaultdict(int)
        # The ledger's count (every process's files) as the scheduler thread saw it at the last
        # poll, and the bytes of stores submitted since.
        self._dir_used = 0
        self._dir_submitted = 0
        self._closed = False
        # Rescan ticks since the last reconciliation (rescan thread only).
        self._ticks_unreconciled = 0
        self._scanner = NamespaceScanner(self.namespace, self._ledger, MEASURE if sized else fb)
        self.scan_seconds = self._warm_start()
        self._warn_if_filesystem_smaller()
        self._rescanner = Rescanner(self._scanner, settings.rescan_interval, self._upkeep)

    # ------------------------------------------------------------------ start-up

    def _warm_start(self) -> float:
        """Index the namespace's block files (up to the capacity); reconcile the ledger.
        Returns the seconds taken."""
        start = time.perf_counter()
        fb = self.file_bytes
        alone = self._ledger.claim_alone()
        if alone:
            remove_all(self.namespace)  # spare files of processes that are gone
        found = [(key, path) for key, path, _ in self._scanner.walk()]
        sizes = [self._measure(path) for _, path in found] if self.sized else [fb] * len(found)
        room = self._room_at_start(sizes)
        on_disk = sum(sizes)
        indexed = self._index_ready([k for k, _ in found[:room]])
        if self.sized:
            for (key, _), size in zip(found[:room], sizes, strict=False):
                self._resize(key, size)
        self._counters["scanned_blocks"] = len(indexed)
        if alone:
            # Files beyond the bound (the directory was used with a larger size) are removed
            # when no other process uses the directory.
            for (_, path), size in zip(found[room:], sizes[room:], strict=True):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    on_disk -= size
        # Writes in progress elsewhere hold reservations: keep them counted.
        on_disk += self._scanner.fresh_temporaries * fb
        self._dir_used = self._ledger.reconcile(on_disk, alone)
        self._ledger.share()
        return time.perf_counter() - start

    def _room_at_start(self, sizes: list[int]) -> int:
        """How many of the files found at start (of ``sizes`` bytes) the index takes: as many
        as the index holds and (compressed) their bytes fit the bound."""
        room = self.capacity_blocks - len(self._policy)
        if not self.sized:
            return room
        budget = self._ledger.capacity
        for i, size in enumerate(sizes[:room]):
            budget -= size
            if budget < 0:
                return i
        return min(room, len(sizes))

    @staticmethod
    def _measure(path: str) -> int:
        """A block file's counted bytes (0 if it vanished)."""
        try:
            return measured_bytes(os.stat(path).st_size)
        except FileNotFoundError:
            return 0

    def _resize(self, key: OffloadKey, size: int) -> None:
        """Record the bytes of ``key``'s file (compressed tiers)."""
        self._stored_bytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size

    def _unsize(self, keys: Sequence[OffloadKey]) -> int:
        """Forget the sizes of ``keys`` (out of the index); returns their bytes."""
        pop, freed = self._sizes.pop, 0
        for key in keys:
            freed += pop(key, 0)
        self._stored_bytes -= freed
        return freed

    def _mean_file_bytes(self) -> int:
        """The bytes a new block's file is expected to take (compressed: the mean so far)."""
        if not self.sized or not self._sizes:
            return self.file_bytes
        return max(MIN_FILE, self._stored_bytes // len(self._sizes))

    def _warn_if_filesystem_smaller(self) -> None:
        """Warn once at start when the filesystem cannot hold the bound (the tier then holds
        what fits: a write that finds it full lowers the tier's limit, see ``diskjobs``)."""
        holds = self._dir_used + free_bytes(self.namespace)
        if self._ledger.capacity > holds:
            logger.warning(
                "kv_disk_size: %.4g GiB is more than the filesystem of %r can hold for the disk "
                "tier (%.4g GiB: %.4g GiB free + %.4g GiB of its files): the tier holds what "
                "fits and evicts when the filesystem is full",
                self.capacity_bytes / 2**30,
                str(self.root),
                holds / 2**30,
                (holds - self._dir_used) / 2**30,
                self._dir_used / 2**30,
            )

    def _upkeep(self) -> None:
        """The rescan thread's other periodic work: the limit after a full filesystem, the
        older formats' namespaces that were in use at the last try, and the ledger's
        reconciliation when it is due (:meth:`reconcile_ledger`)."""
        self._refit_filesystem_when_idle()
        if self._old_namespaces.in_use:
            self._old_namespaces.reclaim()
        self._ticks_unreconciled += 1
        due = self._ticks_unreconciled >= RECONCILE_EVERY_TICKS or self._runner.missing_files
        if due or self._ledger.census().dead_slots:  # a dead process: one locked read a tick
            self.reconcile_ledger()

    def reconcile_ledger(self) -> bool:
        """Make the shared ledger count the namespace's block files, if no process (this one
        included) has a write in flight: a killed writer's reservations, and the bytes of files
        removed by hand, leave the count; killed writers' temporaries and spares, and the spares
        of processes that are gone, are removed. The walk runs unlocked; the count is set only
        if no ledger step of any process came between (else False: the next tick tries again).
        Runs on the rescan thread (each tick it is due: a dead process's slot, a load that
        found a file missing, or every :data:`RECONCILE_EVERY_TICKS` ticks), and at close."""
        census = self._ledger.census()
        if not census.quiescent:
            return False
        counted, garbage = census_files(self.namespace, census.live_owners, measure=self.sized)
        on_disk = counted if self.sized else counted * self.file_bytes
        if not self._ledger.settle_census(census, on_disk, garbage):
            return False
        self._ticks_unreconciled = 0
        self._runner.missing_files = False
        return True

    def _refit_filesystem_when_idle(self) -> None:
        """After the filesystem filled, raise the limit again as space comes back (rescan
        thread; only while no job is in flight, so no write of ours is half counted)."""
        ledger = self._ledger
        if ledger.limit < ledger.capacity and self._runner.idle:
            ledger.refit(lambda: free_bytes(self.namespace), self.file_bytes)

    def _index_ready(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Index ``keys`` found on disk as ready blocks, up to the capacity; returns the keys
        indexed, announced once (``BlockStored``) like the blocks this tier stores, so an event
        consumer's index matches the tier's after a restart too."""
        policy, insert, cap = self._policy, self._policy.insert, self.capacity_blocks
        new_block = OffloadedBlock.__new__
        indexed: list[OffloadKey] = []
        for key in keys:
            if len(policy) >= cap:
                break
            if policy.get(key) is None:
                block = new_block(OffloadedBlock)
                block.slot, block.ref_cnt = -1, 0
                insert(key, block)
                indexed.append(key)
        if self.sized:  # other processes' files: sized as the mean until measured
            estimate = self._mean_file_bytes()
            for key in indexed:
                self._resize(key, estimate)
        if indexed and self._events is not None:
            self._events.append(OffloadingEvent(indexed, self.medium, False, self.locality))
        return indexed

    # ------------------------------------------------------------------ scheduler-thread API

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        block = self._policy.get(key)
        if block is None:
            return _MISS
        return _HIT if block.ref_cnt >= 0 else _HIT_PENDING

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._policy.touch(keys, ctx)

    def submit_store(self, job: TierJob, ctx: ReqContext | None = None) -> None:
        policy = self._policy
        todo: Items = []
        seen: set[OffloadKey] = set()
        for key, slot in zip(job.keys, job.slots, strict=True):
            if key not in seen and policy.get(key) is None:
                todo.append((key, slot))
            seen.add(key)
        running = RunningJob(job, True, len(todo))
        if not todo:
            self._runner.finish(running)
            return
        victims = self._make_room(len(todo), seen)
        if victims is None:
            for key, _ in todo:
                running.failed[key] = "full"
            running.remaining = 0
            self._counters["rejected_stores"] += 1
            self._runner.finish(running)
            return
        for key, _ in todo:
            block = OffloadedBlock.__new__(OffloadedBlock)
            block.slot, block.ref_cnt = -1, PENDING
            policy.insert(key, block)
        if self.sized:
            running.reserved = len(todo) * self._mean_file_bytes() - self._unsize(victims)
        else:
            running.reserved = (len(todo) - len(victims)) * self.file_bytes
        self._dir_submitted += running.reserved
        self._runner.store(running, todo, victims)

    def _make_room(self, count: int, protected: set[OffloadKey]) -> list[OffloadKey] | None:
        """Evict what ``count`` new blocks need: room in the local index and in the shared
        directory (as last seen). Returns the victims (out of the index), or ``None`` when the
        policy cannot free that much (pinned or pending blocks)."""
        policy, fb = self._policy, self._mean_file_bytes()
        need_local = len(policy) + count - self.capacity_blocks
        need_dir = -(
            -(self._dir_used + self._dir_submitted + count * fb - self._ledger.limit) // fb
        )
        need = max(0, need_local, need_dir)
        if not need:
            return []
        self.codec.note_capacity_bound()
        evicted = policy.evict(min(need, len(policy)), protected)
        if evicted is None:
            return None
        victims = [key for key, _ in evicted]
        self._counters["evicted_blocks"] += len(victims)
        if self._events is not None:
            self._events.append(OffloadingEvent(victims, self.medium, True, self.locality))
        return victims

    def submit_load(self, job: TierJob, ctx: ReqContext | None = None) -> None:
        get = self._policy.get
        todo: Items = []
        running = RunningJob(job, False, 0)
        for key, slot in zip(job.keys, job.slots, strict=True):
            block = get(key)
            if block is None or block.ref_cnt < 0:
                running.failed[key] = "missing"
                continue
            block.ref_cnt += 1
            todo.append((key, slot))
        running.remaining = len(todo)
        running.pinned = [key for key, _ in todo]
        if not todo:
            self._runner.finish(running)
            return
        self._runner.load(running, todo)

    def get_finished_jobs(self) -> list[TierJobResult]:
        discovered = self._rescanner.discovered
        while discovered:
            self._counters["discovered_blocks"] += len(self._index_ready(discovered.popleft()))
        results: list[TierJobResult] = []
        done = self._runner.done
        while done:
            running = done.popleft()
            self._dir_submitted -= running.reserved
            if running.is_store:
                self._apply_store(running)
            else:
                self._apply_load(running)
            job = running.job
            results.append(
                TierJobResult(
                    job.job_id,
                    running.is_store,
                    dict(running.failed),
                    running.nbytes,
                    time.perf_counter() - running.start,
                )
            )
        if results:
            self._dir_used = self._ledger.last_seen
        return results

    def _apply_store(self, running: RunningJob) -> None:
        """A finished store: its written keys become readable, its failed ones leave."""
        policy, counters, failed = self._policy, self._counters, running.failed
        stored: list[OffloadKey] = []
        for key in dict.fromkeys(running.job.keys):
            block = policy.get(key)
            if block is None or block.ref_cnt != PENDING:
                continue  # skipped (already held) or not ours
            if key in failed:
                policy.remove(key)
                self._unsize((key,))
            else:
                block.ref_cnt = 0
                stored.append(key)
                if self.sized:
                    self._resize(key, running.sizes.get(key, self.file_bytes))
        counters["stored_blocks"] += len(stored)
        counters["failed_store_blocks"] += len(failed)
        counters["filesystem_full_stores"] += running.filesystem_full
        for cause in failed.values():
            counters[f"failed_store_{cause}"] += 1
        if stored and self._events is not None:
            self._events.append(OffloadingEvent(stored, self.medium, False, self.locality))

    def _apply_load(self, running: RunningJob) -> None:
        """A finished load: its keys are unpinned; bad or vanished files leave the index."""
        policy, counters, failed = self._policy, self._counters, running.failed
        for key in running.pinned:
            block = policy.get(key)
            if block is not None and block.ref_cnt > 0:
                block.ref_cnt -= 1
        counters["loaded_blocks"] += len(running.job.keys) - len(failed)
        counters["failed_load_blocks"] += len(failed)
        dropped: list[OffloadKey] = []
        for key, cause in failed.items():
            counters[f"failed_load_{cause}"] += 1
            block = policy.get(key)
            if block is not None and cause in _DROP_CAUSES and block.ref_cnt == 0:
                policy.remove(key)
                dropped.append(key)
        self._unsize(dropped)
        if dropped and self._events is not None:
            self._events.append(OffloadingEvent(dropped, self.medium, True, self.locality))

    def drain_jobs(self) -> None:
        self._runner.drain()

    @property
    def index(self) -> EvictionPolicy:
        """The tier's index of ref-counted block records (operator pins hold references)."""
        return self._policy

    def drop_evictable(self) -> list[OffloadKey]:
        """Remove every ready, unreferenced block (an operator's clear: pinned blocks and blocks
        being written or read stay) and its file, as evictions; returns their keys."""
        policy = self._policy
        count = 0
        for key in policy:
            block = policy.get(key)
            count += block is not None and block.ref_cnt == 0
        evicted = policy.evict(count, ()) if count else None
        if not evicted:
            return []
        victims = [key for key, _ in evicted]
        for key in victims:
            self._ledger.remove(self._files.path_of(key), self.file_bytes)
        self._dir_used = self._ledger.last_seen
        self._counters["evicted_blocks"] += len(victims)
        if self._events is not None:
            self._events.append(OffloadingEvent(victims, self.medium, True, self.locality))
        return victims

    def reset(self) -> None:
        """Drop every block of this tier's index and delete its files (pinned loads finish first)."""
        self.drain_jobs()
        self.get_finished_jobs()
        keys = list(self._policy)
        removed = MEASURE if self.sized else self.file_bytes
        for key in keys:
            self._ledger.remove(self._files.path_of(key), removed)
        self._dir_used, self._dir_submitted = self._ledger.last_seen, 0
        self._policy.clear()
        self._sizes.clear()
        self._stored_bytes = 0
        if keys and self._events is not None:
            self._events.append(OffloadingEvent(keys, self.medium, True, self.locality))

    def stats(self) -> dict[str, int]:
        used = len(self._policy)
        stored = self._stored_bytes if self.sized else used * self.file_bytes
        out = {
            "capacity_bytes": self.capacity_bytes,
            "capacity_blocks": min(
                self.capacity_blocks, self._ledger.limit // self._mean_file_bytes()
            ),
            "used_blocks": used,
            "used_bytes": stored + LEDGER_BYTES,
            "dir_used_bytes": self._dir_used + LEDGER_BYTES,
            "scan_ms": int(self.scan_seconds * 1000),
        }
        counters = self._counters
        for name in _COUNTERS:
            out[name] = counters[name]
        for cause in _CAUSES:
            out[f"failed_load_{cause}"] = counters[f"failed_load_{cause}"]
            out[f"failed_store_{cause}"] = counters[f"failed_store_{cause}"]
        out.update(self.codec.stats.as_stats())
        return out

    def check_ledger(self) -> None:
        """Raise ``AssertionError`` unless the shared ledger counts exactly the namespace's files
        (one block file's bytes per block file and per write in progress). For tests: drains
        this tier's jobs first; other processes on the directory must be idle."""
        self.drain_jobs()
        if self.sized:
            count, on_disk = self._ledger.snapshot(lambda: count_file_bytes(self.namespace))
        else:
            count, on_disk = self._ledger.snapshot(
                lambda: count_files(self.namespace) * self.file_bytes
            )
        if count != on_disk:
            raise AssertionError(
                f"the ledger counts {count} bytes, the namespace's files take {on_disk}"
            )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._rescanner.close()
        self._runner.close()
        self._spares.close()
        if self._runner.missing_files or self._ledger.census().dead_slots:
            try:
                self.reconcile_ledger()
            except OSError as exc:  # the next process reconciles
                logger.warning("disk tier: reconciling the ledger at close failed: %s", exc)
        self._ledger.close()
