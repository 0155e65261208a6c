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
beside it do the rest: ``jobs`` (the I/O threads), ``files`` (one block file), ``ledger`` (the
shared byte count), ``sizes`` (a compressed tier's file sizes), ``scan`` (finding files),
``upkeep`` (the rescan thread's periodic work), ``directory`` (the directory).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

from kvoffload.errors import ConfigError
from kvoffload.eviction import EvictionPolicy, OffloadedBlock, create_eviction_policy
from kvoffload.eviction.base import PENDING
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import EventQueueMixin, LookupResult, OffloadingEvent, ReqContext
from kvoffload.tiers.codec import BlockCodec
from kvoffload.tiers.contract import KVLayout, ResultSignal, SecondaryTier, TierJob, TierJobResult
from kvoffload.tiers.disk.counters import counter_stats
from kvoffload.tiers.disk.directory import (
    check_o_direct,
    join_namespace,
    superseded_namespaces,
    warn_if_filesystem_smaller,
)
from kvoffload.tiers.disk.files import BlockFiles, file_bytes
from kvoffload.tiers.disk.jobs import DiskJobRunner, Items, RunningJob
from kvoffload.tiers.disk.ledger import MEASURE
from kvoffload.tiers.disk.reclaim import OldNamespaces
from kvoffload.tiers.disk.scan import NamespaceScanner, Rescanner, count_file_bytes, count_files
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.sizes import MIN_FILE, FileSizes, files_that_fit, measure_file
from kvoffload.tiers.disk.spares import SparePool, remove_all
from kvoffload.tiers.disk.upkeep import LedgerUpkeep

__all__ = ["LEDGER_BYTES", "DiskTier"]

logger = logging.getLogger(__name__)

_MISS, _HIT, _HIT_PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING
#: The ledger file's share of the bound.
LEDGER_BYTES = 4096
_DROP_CAUSES = frozenset(("missing", "checksum", "corrupt", "layout"))
#: Empty files kept ready for writes (made while idle; see ``spares``).
SPARE_FILES = 64


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
        #: Bytes of each indexed block's file (compressed tiers) and their sum.
        self._sizes = FileSizes(fb)
        self.root = Path(settings.path)
        # The namespace, held (shared, or exclusive while alone) before anything reads it.
        self.namespace, self._ledger, alone = join_namespace(
            self.root, stored_layout, ".z" if sized else "", self.capacity_bytes - LEDGER_BYTES
        )
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
            self.result_signal,
        )
        self._counters: dict[str, int] = collections.defaultdict(int)
        # The ledger's count (every process's files) as the scheduler thread saw it at the last
        # poll, and the bytes of stores submitted since.
        self._dir_used = 0
        self._dir_submitted = 0
        self._closed = False
        self._upkeep = LedgerUpkeep(
            self.namespace, self._ledger, self._runner, self._old_namespaces, fb, sized
        )
        self._scanner = NamespaceScanner(self.namespace, self._ledger, MEASURE if sized else fb)
        self.scan_seconds = self._warm_start(alone)
        # Once at start (the tier then holds what fits: see ``jobs``).
        warn_if_filesystem_smaller(
            self.root, self.namespace, self.capacity_bytes, self._ledger.capacity, self._dir_used
        )
        self._rescanner = Rescanner(self._scanner, settings.rescan_interval, self._upkeep.tick)

    # ------------------------------------------------------------------ start-up

    def _warm_start(self, alone: bool) -> float:
        """Index the namespace's block files (up to the capacity); reconcile the ledger (``alone``:
        no other process uses the namespace, the users lock held exclusively till the end).
        Returns the seconds taken."""
        start = time.perf_counter()
        fb = self.file_bytes
        if alone:
            remove_all(self.namespace)  # spare files of processes that are gone
        found = [(key, path) for key, path, _ in self._scanner.walk()]
        sizes = [measure_file(path) for _, path in found] if self.sized else [fb] * len(found)
        # As many as the index holds and (compressed) their bytes fit the bound.
        room = self.capacity_blocks - len(self._policy)
        if self.sized:
            room = files_that_fit(sizes, room, self._ledger.capacity)
        on_disk = sum(sizes)
        indexed = self._index_ready([k for k, _ in found[:room]])
        if self.sized:
            for (key, _), size in zip(found[:room], sizes, strict=False):
                self._sizes.resize(key, size)
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

    def _mean_file_bytes(self) -> int:
        """The bytes a new block's file is expected to take (compressed: the mean so far)."""
        return self._sizes.mean() if self.sized else self.file_bytes

    def reconcile_ledger(self) -> bool:
        """Make the shared ledger count the namespace's block files, if no process has a write
        in flight (else False: the rescan thread tries again): :meth:`LedgerUpkeep.reconcile`."""
        return self._upkeep.reconcile()

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
                self._sizes.resize(key, estimate)
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
            running.reserved = len(todo) * self._mean_file_bytes() - self._sizes.forget(victims)
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

    def set_result_signal(self, signal: ResultSignal) -> None:
        super().set_result_signal(signal)
        self._runner.result_signal = signal

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
                self._sizes.forget((key,))
            else:
                block.ref_cnt = 0
                stored.append(key)
                if self.sized:
                    self._sizes.resize(key, running.sizes.get(key, self.file_bytes))
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
        self._sizes.forget(dropped)
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
        if keys and self._events is not None:
            self._events.append(OffloadingEvent(keys, self.medium, True, self.locality))

    def stats(self) -> dict[str, int]:
        used = len(self._policy)
        stored = self._sizes.total if self.sized else used * self.file_bytes
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
        out.update(counter_stats(self._counters))
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
