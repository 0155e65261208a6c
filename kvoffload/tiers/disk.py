"""The disk tier: blocks as self-checking files in a directory, bounded, crash-safe and shareable.

See ``docs/disk-tier.md``. In short:

* **Bounded.** The namespace's block files (header + payload, in whole 4 KiB blocks) and its ledger
  never exceed ``capacity_bytes``. The byte count is shared by every process on the directory
  (:class:`~kvoffload.tiers.diskfiles.SpaceLedger`); a writer reserves before it writes and evicts
  its own index's blocks (by the eviction policy) when the directory is full.
* **Crash-safe.** A file appears under its final name only complete (temporary name, then
  ``link``); every load checks the header (magic, version, layout fingerprint, key) and the xxh3
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

Scheduler-thread methods touch only the in-memory index; all file I/O runs on a thread pool and
moves payloads with ``os.preadv``/``os.pwritev`` straight to and from the host pool.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvoffload.base import LookupResult, OffloadingEvent, ReqContext
from kvoffload.errors import ConfigError
from kvoffload.eviction import EvictionPolicy, OffloadedBlock, create_eviction_policy
from kvoffload.eviction.base import PENDING
from kvoffload.keys import OffloadKey
from kvoffload.tiers.base import KVLayout, SecondaryTier, TierJob, TierJobResult
from kvoffload.tiers.blockformat import CorruptBlockError
from kvoffload.tiers.diskfiles import (
    BlockFiles,
    FaultHook,
    SpaceLedger,
    file_bytes,
    is_no_space,
)

__all__ = ["DiskTier"]

logger = logging.getLogger(__name__)

_MISS, _HIT, _HIT_PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING
#: The ledger file's share of the bound.
LEDGER_BYTES = 4096
_DROP_CAUSES = frozenset(("missing", "checksum", "corrupt", "layout"))
_CAUSES = ("missing", "checksum", "corrupt", "layout", "io", "timeout", "full")


class _Running:
    """A submitted job until its last block finished (touched by I/O threads under ``lock``)."""

    __slots__ = (
        "failed",
        "is_store",
        "job",
        "lock",
        "nbytes",
        "pinned",
        "remaining",
        "reserved",
        "start",
    )

    def __init__(self, job: TierJob, is_store: bool, remaining: int) -> None:
        self.job = job
        self.is_store = is_store
        self.failed: dict[OffloadKey, str] = {}
        self.remaining = remaining
        self.nbytes = 0
        self.pinned: list[OffloadKey] = []  # a load's keys pinned in the index
        self.reserved = 0  # a store's net bytes, counted in DiskTier._dir_submitted until reported
        self.start = time.perf_counter()
        self.lock = threading.Lock()


class DiskTier(SecondaryTier):
    """A :class:`SecondaryTier` on a local or shared filesystem (see the module docstring).

    ``capacity_bytes`` bounds the namespace on disk; ``eviction_policy`` is a registry name;
    ``num_threads`` I/O threads; ``o_direct`` bypasses the page cache (needs 4 KiB aligned pool
    and block size and a filesystem that supports it); ``rescan_interval`` (s, 0 = never) is how
    often other processes' new files are looked for; ``fault_hook`` injects OS errors (tests).
    Bad settings raise :class:`ConfigError` naming ``kv_disk_path`` / ``kv_disk_size``.
    """

    name = "disk"
    locality = "LOCAL"

    def __init__(
        self,
        pool: memoryview,
        layout: KVLayout,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        eviction_policy: str | EvictionPolicy = "adaptive",
        num_threads: int = 4,
        o_direct: bool = False,
        rescan_interval: float = 2.0,
        enable_events: bool = False,
        fault_hook: FaultHook | None = None,
    ) -> None:
        super().__init__(pool, layout)
        self.file_bytes = fb = file_bytes(layout.block_bytes)
        if not capacity_bytes >= LEDGER_BYTES + fb:  # also rejects NaN
            raise ConfigError(
                "kv_disk_size",
                f"{capacity_bytes!r} bytes do not hold one block file of {fb} bytes "
                f"(+{LEDGER_BYTES} for the ledger)",
            )
        self.capacity_bytes = int(capacity_bytes)
        self.capacity_blocks = (self.capacity_bytes - LEDGER_BYTES) // fb
        self.root = Path(path)
        self.namespace = _prepare_directory(self.root, layout)
        flat = pool.cast("B") if pool.ndim != 1 else pool
        if o_direct:
            _check_o_direct(self.namespace, flat, layout.block_bytes)
        self._files = BlockFiles(
            self.namespace, layout.fingerprint(), flat, layout.block_bytes, o_direct, fault_hook
        )
        self._ledger = SpaceLedger(self.namespace / "ledger", self.capacity_bytes - LEDGER_BYTES)
        self._policy = (
            create_eviction_policy(eviction_policy, self.capacity_blocks)
            if isinstance(eviction_policy, str)
            else eviction_policy
        )
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._done: collections.deque[_Running] = collections.deque()
        self._discovered: collections.deque[list[OffloadKey]] = collections.deque()
        self._inflight = 0
        self._idle = threading.Condition()
        self._pool = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix="kvoffload-disk")
        self._num_threads = max(1, num_threads)
        self._closed = False
        self._counters: dict[str, int] = collections.defaultdict(int)
        # The ledger's count (every process's files) as the scheduler thread saw it at the last
        # poll, and the bytes of stores submitted since.
        self._dir_used = 0
        self._dir_submitted = 0
        self.scan_seconds = self._warm_start()
        self._stop = threading.Event()
        self._rescanner: threading.Thread | None = None
        if rescan_interval > 0:
            self._rescanner = threading.Thread(
                target=self._rescan_loop,
                args=(rescan_interval,),
                name="kvoffload-disk-rescan",
                daemon=True,
            )
            self._rescanner.start()

    # ------------------------------------------------------------------ start-up

    def _warm_start(self) -> float:
        """Index every block file of the namespace; reconcile the ledger. Returns seconds taken."""
        start = time.perf_counter()
        policy, fb, cap = self._policy, self.file_bytes, self.capacity_blocks
        get, insert, new_block = policy.get, policy.insert, OffloadedBlock.__new__
        alone = self._ledger.claim_alone()
        self._dir_mtimes: dict[str, float] = {}
        self._seen: dict[str, set[str]] = {}
        extra: list[str] = []
        indexed: list[OffloadKey] = []
        on_disk = 0
        names: set[str] = set()
        current = None
        for key, sub, name in self._files.scan():
            if sub is not current:
                current, names = sub, self._seen.setdefault(sub, set())
            names.add(name)
            on_disk += fb
            if len(policy) < cap and get(key) is None:
                block = new_block(OffloadedBlock)
                block.slot, block.ref_cnt = -1, 0
                insert(key, block)
                indexed.append(key)
            elif alone:
                extra.append(os.path.join(sub, name))
        for sub in self._seen:
            with contextlib.suppress(FileNotFoundError):
                self._dir_mtimes[sub] = os.stat(sub).st_mtime
        # Files beyond the bound (the directory was used with a larger size) are removed, when
        # no other process uses the directory.
        for path in extra:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                on_disk -= fb
        # Writes in progress elsewhere hold reservations: keep them counted.
        on_disk += self._files.fresh_temporaries * fb
        on_disk = self._ledger.reconcile(on_disk, alone)
        self._ledger.share()
        self._dir_used = on_disk
        self._counters["scanned_blocks"] = len(policy)
        self._announce(indexed)
        return time.perf_counter() - start

    # ------------------------------------------------------------------ scheduler-thread API

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        block = self._policy.get(key)
        if block is None:
            return _MISS
        return _HIT if block.ref_cnt >= 0 else _HIT_PENDING

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._policy.touch(keys, ctx)

    def submit_store(self, job: TierJob, ctx: ReqContext | None = None) -> None:
        policy, fb = self._policy, self.file_bytes
        todo: list[tuple[OffloadKey, int]] = []
        seen: set[OffloadKey] = set()
        for key, slot in zip(job.keys, job.slots, strict=True):
            if key not in seen and policy.get(key) is None:
                todo.append((key, slot))
            seen.add(key)
        running = _Running(job, True, len(todo))
        if not todo:
            self._finish(running)
            return
        # Room: the local index and the shared directory (as last seen) must both take the keys.
        need_local = len(policy) + len(todo) - self.capacity_blocks
        new_bytes = len(todo) * fb
        need_dir = -(
            -(self._dir_used + self._dir_submitted + new_bytes - self._ledger.capacity) // fb
        )
        need = max(0, need_local, need_dir)
        victims: list[OffloadKey] = []
        if need:
            evicted = policy.evict(min(need, len(policy)), seen)
            if evicted is None:
                for key, _ in todo:
                    running.failed[key] = "full"
                running.remaining = 0
                self._counters["rejected_stores"] += 1
                self._finish(running)
                return
            victims = [key for key, _ in evicted]
            self._counters["evicted_blocks"] += len(victims)
            if self._events is not None:
                self._events.append(OffloadingEvent(victims, self.medium, True, self.locality))
        for key, _ in todo:
            block = OffloadedBlock.__new__(OffloadedBlock)
            block.slot, block.ref_cnt = -1, PENDING
            policy.insert(key, block)
        running.reserved = new_bytes - len(victims) * fb
        self._dir_submitted += running.reserved
        with self._idle:
            self._inflight += 1
        self._pool.submit(self._store_job, running, todo, victims)

    def submit_load(self, job: TierJob, ctx: ReqContext | None = None) -> None:
        get = self._policy.get
        todo: list[tuple[OffloadKey, int]] = []
        running = _Running(job, False, 0)
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
            self._finish(running)
            return
        with self._idle:
            self._inflight += 1
        for chunk in self._chunks(todo):
            self._pool.submit(self._load_blocks, running, chunk)

    def _chunks(
        self, items: list[tuple[OffloadKey, int]]
    ) -> list[list[tuple[OffloadKey, int]]]:
        """``items`` split into one run of consecutive blocks per I/O thread."""
        n = len(items)
        size = max(1, -(-n // self._num_threads))
        return [items[i : i + size] for i in range(0, n, size)]

    def get_finished_jobs(self) -> list[TierJobResult]:
        while self._discovered:
            self._index_discovered(self._discovered.popleft())
        results: list[TierJobResult] = []
        done = self._done
        while done:
            running = done.popleft()
            results.append(self._apply(running))
        if results:
            self._dir_used = self._ledger.last_seen
        return results

    def _apply(self, running: _Running) -> TierJobResult:
        """Update the index for a finished job (scheduler thread) and build its result."""
        policy, counters, failed = self._policy, self._counters, running.failed
        job = running.job
        dropped: list[OffloadKey] = []
        self._dir_submitted -= running.reserved
        if running.is_store:
            stored: list[OffloadKey] = []
            for key in dict.fromkeys(job.keys):
                block = policy.get(key)
                if block is None or block.ref_cnt != PENDING:
                    continue  # skipped (already held) or not ours
                if key in failed:
                    policy.remove(key)
                else:
                    block.ref_cnt = 0
                    stored.append(key)
            counters["stored_blocks"] += len(stored)
            counters["failed_store_blocks"] += len(failed)
            for cause in failed.values():
                counters[f"failed_store_{cause}"] += 1
            if stored and self._events is not None:
                self._events.append(OffloadingEvent(stored, self.medium, False, self.locality))
        else:
            for key in running.pinned:
                block = policy.get(key)
                if block is not None and block.ref_cnt > 0:
                    block.ref_cnt -= 1
            counters["loaded_blocks"] += len(job.keys) - len(failed)
            counters["failed_load_blocks"] += len(failed)
            for key, cause in failed.items():
                counters[f"failed_load_{cause}"] += 1
                block = policy.get(key)
                if block is not None and cause in _DROP_CAUSES and block.ref_cnt == 0:
                    policy.remove(key)
                    dropped.append(key)
            if dropped and self._events is not None:
                self._events.append(OffloadingEvent(dropped, self.medium, True, self.locality))
        return TierJobResult(
            job.job_id,
            running.is_store,
            dict(failed),
            running.nbytes,
            time.perf_counter() - running.start,
        )

    def _index_discovered(self, keys: list[OffloadKey]) -> None:
        policy = self._policy
        indexed: list[OffloadKey] = []
        for key in keys:
            if len(policy) >= self.capacity_blocks:
                break
            if policy.get(key) is None:
                block = OffloadedBlock.__new__(OffloadedBlock)
                block.slot, block.ref_cnt = -1, 0
                policy.insert(key, block)
                indexed.append(key)
        self._counters["discovered_blocks"] += len(indexed)
        self._announce(indexed)

    def _announce(self, keys: list[OffloadKey]) -> None:
        """One stored event for blocks that entered the index from files (the warm-start scan,
        the rescan): every block in the index is announced once, like the ones this tier
        stored, so an event consumer's index matches the tier's after a restart too."""
        if keys and self._events is not None:
            self._events.append(OffloadingEvent(keys, self.medium, False, self.locality))

    def drain_jobs(self) -> None:
        with self._idle:
            while self._inflight:
                self._idle.wait()

    def take_events(self) -> list[OffloadingEvent]:
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def reset(self) -> None:
        """Drop every block of this tier's index and delete its files (pinned loads finish first)."""
        self.drain_jobs()
        self.get_finished_jobs()
        keys = list(self._policy)
        for key in keys:
            self._ledger.remove(self._files.path_of(key), self.file_bytes)
        self._dir_used, self._dir_submitted = self._ledger.last_seen, 0
        self._policy.clear()
        if keys and self._events is not None:
            self._events.append(OffloadingEvent(keys, self.medium, True, self.locality))

    def stats(self) -> dict[str, int]:
        out = {
            "capacity_bytes": self.capacity_bytes,
            "capacity_blocks": self.capacity_blocks,
            "used_blocks": len(self._policy),
            "used_bytes": len(self._policy) * self.file_bytes + LEDGER_BYTES,
            "dir_used_bytes": self._dir_used + LEDGER_BYTES,
            "scan_ms": int(self.scan_seconds * 1000),
        }
        for name in (
            "stored_blocks",
            "loaded_blocks",
            "evicted_blocks",
            "failed_load_blocks",
            "failed_store_blocks",
            "rejected_stores",
            "scanned_blocks",
            "discovered_blocks",
        ):
            out[name] = self._counters[name]
        for cause in _CAUSES:
            out[f"failed_load_{cause}"] = self._counters[f"failed_load_{cause}"]
            out[f"failed_store_{cause}"] = self._counters[f"failed_store_{cause}"]
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self.drain_jobs()
        self._pool.shutdown(wait=True)
        if self._rescanner is not None:
            self._rescanner.join()
        self._ledger.close()

    # ------------------------------------------------------------------ I/O threads

    def _store_job(
        self, running: _Running, items: list[tuple[OffloadKey, int]], victims: list[OffloadKey]
    ) -> None:
        """A store's first step: unlink its victims and reserve the bytes of all its blocks in
        one ledger step, before any block is written (so no block of the job can find the
        directory full for lack of its own victims' room); then write the blocks that fit over
        the I/O threads. Blocks that do not fit (other processes took the room) fail ``"full"``;
        the job keeps the longest prefix."""
        fb = self.file_bytes
        path_of = self._files.path_of
        try:
            fit = self._ledger.reserve_blocks(len(items), fb, [path_of(k) for k in victims])
        except Exception as exc:  # never lose a job: its blocks fail
            logger.exception("disk tier: reserving %d blocks failed: %s", len(items), exc)
            self._chunk_done(running, len(items), dict.fromkeys((k for k, _ in items), "io"), 0)
            return
        if fit < len(items):
            full = dict.fromkeys((k for k, _ in items[fit:]), "full")
            self._chunk_done(running, len(items) - fit, full, 0)
        if not fit:
            return
        first, *rest = self._chunks(items[:fit])
        for chunk in rest:
            self._pool.submit(self._store_blocks, running, chunk)
        self._store_blocks(running, first)

    def _store_blocks(self, running: _Running, items: list[tuple[OffloadKey, int]]) -> None:
        """Write blocks whose bytes :meth:`_store_job` reserved; return the unused bytes (failed
        writes, blocks another process published first) in one ledger step."""
        write, fb = self._files.write, self.file_bytes
        failed: dict[OffloadKey, str] = {}
        nbytes = unused = 0
        for key, slot in items:
            try:
                if not write(key, slot):
                    unused += 1  # another process published it
                nbytes += self.layout.block_bytes
            except OSError as exc:
                unused += 1
                failed[key] = "full" if is_no_space(exc) else "io"
                logger.warning("disk tier: storing %s failed: %s", key.hex()[:16], exc)
            except Exception as exc:  # never lose a job: report it failed
                unused += 1
                failed[key] = "io"
                logger.exception("disk tier: storing %s failed: %s", key.hex()[:16], exc)
        if unused:
            try:
                self._ledger.release(unused * fb)
            except Exception:  # the count drifts high (conservative) until a restart reconciles
                logger.exception("disk tier: returning %d bytes to the ledger failed", unused * fb)
        self._chunk_done(running, len(items), failed, nbytes)

    def _load_blocks(self, running: _Running, items: list[tuple[OffloadKey, int]]) -> None:
        files = self._files
        read, head_buf = files.read, files.header_buffer()
        failed: dict[OffloadKey, str] = {}
        nbytes = 0
        for key, slot in items:
            try:
                read(key, slot, head_buf)
                nbytes += self.layout.block_bytes
            except FileNotFoundError:
                failed[key] = "missing"
            except CorruptBlockError as exc:
                failed[key] = exc.cause
                logger.warning("disk tier: dropping bad block file %s: %s", key.hex()[:16], exc)
                with contextlib.suppress(OSError):
                    self._ledger.remove(files.path_of(key), self.file_bytes)
            except OSError as exc:
                failed[key] = "io"
                logger.warning("disk tier: loading %s failed: %s", key.hex()[:16], exc)
            except Exception as exc:
                failed[key] = "io"
                logger.exception("disk tier: loading %s failed: %s", key.hex()[:16], exc)
        if isinstance(head_buf, mmap.mmap):
            head_buf.close()
        self._chunk_done(running, len(items), failed, nbytes)

    def _chunk_done(
        self, running: _Running, n: int, failed: dict[OffloadKey, str], nbytes: int
    ) -> None:
        with running.lock:
            running.failed.update(failed)
            running.nbytes += nbytes
            running.remaining -= n
            last = running.remaining == 0
        if last:
            self._finish(running, dispatched=True)

    def _finish(self, running: _Running, dispatched: bool = False) -> None:
        self._done.append(running)
        if dispatched:
            with self._idle:
                self._inflight -= 1
                self._idle.notify_all()

    def _rescan_loop(self, interval: float) -> None:
        """Find block files other processes wrote: rescan hash directories whose mtime changed."""
        while not self._stop.wait(interval):
            try:
                self._rescan_once()
            except Exception:  # never let a transient filesystem error kill discovery
                logger.exception("disk tier: rescan failed")

    def _rescan_once(self) -> None:
        now = time.time()
        found: list[OffloadKey] = []
        try:
            subdirs = list(os.scandir(self.namespace))
        except FileNotFoundError:
            return
        for sub in subdirs:
            if not sub.is_dir(follow_symlinks=False):
                continue
            mtime = sub.stat().st_mtime
            if self._dir_mtimes.get(sub.path) == mtime:
                continue
            self._dir_mtimes[sub.path] = mtime
            seen = self._seen.setdefault(sub.path, set())
            names = set()
            for key, _, name in self._files.scan_dir(sub.path, now):
                names.add(name)
                if name not in seen:
                    found.append(key)
            self._seen[sub.path] = names
        if found:
            self._discovered.append(found)


def _prepare_directory(root: Path, layout: KVLayout) -> Path:
    """Create (if needed) and check the namespace directory for ``layout`` under ``root``."""
    if root.exists() and not root.is_dir():
        raise ConfigError("kv_disk_path", f"{str(root)!r} exists and is not a directory")
    namespace = root / "kvoffload-v1" / layout.fingerprint().hex()
    try:
        namespace.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError("kv_disk_path", f"cannot create {str(namespace)!r}: {exc}") from exc
    probe = namespace / f".probe.{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError("kv_disk_path", f"{str(root)!r} is not writable: {exc}") from exc
    return namespace


def _check_o_direct(namespace: Path, pool: memoryview, block_bytes: int) -> None:
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(pool)) if not pool.readonly else 0
    if block_bytes % 4096 or address % 4096:
        raise ConfigError(
            "kv_disk_o_direct",
            f"O_DIRECT needs 4 KiB aligned blocks and pool (block {block_bytes} bytes, "
            f"pool at {address:#x})",
        )
    probe = namespace / f".odirect.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o644)
        os.close(fd)
    except OSError as exc:
        raise ConfigError(
            "kv_disk_o_direct", f"the filesystem of {str(namespace)!r} refuses O_DIRECT: {exc}"
        ) from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()
